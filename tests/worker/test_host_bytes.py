"""``CacheController.host_bytes`` counts every host byte the controller holds, and ``free()``
lets go of all of it exactly once, for every tier configuration: no host memory, swap pages
only, a host tier only (policies ``"eviction"`` and ``"write_through"``), swap pages and a
host tier. (A remote tier behind the host tier: ``tests/store/test_host_bytes_remote.py``.)

The layout: GQA, 2 KV heads of width 8, bf16, block 16, a 32-token window group ``swa``
(layers 0, 2) and a full group ``kv`` (layers 1, 3). One page of a group holds one block of
``key`` and ``value`` of each of its two layers, unpadded:

    16 tokens * 2 heads * 8 * 2 bytes = 512 bytes per role and block
    512 * 2 roles * 2 layers          = 2,048 bytes per page, in either group
"""

from __future__ import annotations

import dataclasses
import gc
import weakref

import numpy as np
import pytest

from kvforge import CacheController, GQABackend
from kvforge.core.values import PageCopy
from kvforge.errors import WorkerRefusedError
from kvforge.verify import token_seeds, write_step
from kvforge.worker import host_memory

PAGE = 16 * 2 * 8 * 2 * 2 * 2  # bytes of one page of either group: 2,048
SWAP_PAGES = 10  # per group, the null page included
TIER_PAGES = 32


class CountingGQA(GQABackend):
    """A GQA backend that counts the frees of the host views it made."""

    def __init__(self, *args, **kw) -> None:
        super().__init__(*args, **kw)
        self.host_frees = 0

    def free_host_kv_cache(self, host_caches) -> None:
        self.host_frees += 1
        super().free_host_kv_cache(host_caches)


def controller(swap: bool, tier: str | None) -> tuple[CacheController, list[CountingGQA]]:
    swa = CountingGQA(2, 8, block_size=16, sliding_window=32)
    kv = CountingGQA(2, 8, block_size=16)
    ctl = CacheController({0: swa, 1: kv, 2: swa, 3: kv}, enable_prefix_caching=True)
    ctl.initialize_kv_cache(num_blocks=24, max_num_seqs=2, max_model_len=512)
    if swap:
        ctl.initialize_host_cache(num_pages=SWAP_PAGES)
    if tier is not None:
        ctl.initialize_host_tier(num_pages=TIER_PAGES, policy=tier)
    return ctl, [swa, kv]


def prefill(ctl: CacheController, rid: str, toks: np.ndarray) -> None:
    seeds, done = token_seeds(toks), 0
    while done < len(toks):
        n = min(64, len(toks) - done)
        step = ctl.schedule([rid], [n], new_token_ids=[toks[done : done + n]])
        assert not step.allocation.refused
        write_step(ctl, step, {rid: seeds})
        ctl.end_step(step)
        done += n


#: (swap pages, host tier policy, bytes held: pages * groups * bytes per page)
CONFIGS = [
    pytest.param(False, None, 0, id="no-host-memory"),
    pytest.param(True, None, SWAP_PAGES * 2 * PAGE, id="swap-only"),  # 40,960
    pytest.param(False, "eviction", TIER_PAGES * 2 * PAGE, id="tier-eviction"),  # 131,072
    pytest.param(False, "write_through", TIER_PAGES * 2 * PAGE, id="tier-write-through"),
    pytest.param(True, "eviction", (SWAP_PAGES + TIER_PAGES) * 2 * PAGE, id="swap-and-tier"),
]


def test_the_page_arithmetic_is_the_layouts():
    ctl, _ = controller(False, None)
    assert PAGE == 2048
    assert {g: ctl.layout.host_page_bytes(g) for g in ctl.groups} == {"swa": PAGE, "kv": PAGE}
    assert SWAP_PAGES * 2 * PAGE == 40_960 and TIER_PAGES * 2 * PAGE == 131_072
    ctl.free()


@pytest.mark.parametrize(("swap", "tier", "held"), CONFIGS)
def test_host_bytes_counts_every_host_byte_and_free_lets_go_of_all_once(swap, tier, held):
    ctl, backends = controller(swap, tier)
    assert ctl.host_bytes == held
    # in use: a prompt cached, then evicted to the tier by others; the pages were there already
    prefill(ctl, "a", np.arange(1, 161))
    ctl.free_request("a")
    for i in range(3):
        prefill(ctl, f"other{i}", np.random.default_rng(i).integers(40_000, 50_000, 160))
        ctl.free_request(f"other{i}")
    if tier is not None:
        assert len(ctl.host_tier) > 0  # the tier holds pages of cached prompts now
    assert ctl.host_bytes == held
    pages = []
    if swap:
        pages += [p.pages for p in ctl.storage.host.groups.values()]
    tier_pages = host_memory.tier_pages_of(ctl.storage)
    if tier is not None:
        pages += [p.pages for p in tier_pages.groups.values()]
        scheduler_tier = ctl.host_tier
    assert sum(p.numel() for p in pages) == held  # what host_bytes counts is what exists
    gone = [weakref.ref(p) for p in pages]
    del pages, tier_pages

    ctl.free()
    gc.collect()
    assert ctl.host_bytes == 0 and ctl.closed
    assert all(ref() is None for ref in gone)  # no page tensor is held by anything any more
    assert host_memory.tier_pages_of(ctl.storage) is None
    assert ctl.host_kv_caches == {}
    assert [b.host_frees for b in backends] == ([1, 1] if swap else [0, 0])
    if tier is not None:  # the scheduler side's index let go of its pages and records too
        assert len(scheduler_tier) == 0
        assert all(scheduler_tier.pool(g).num_used == 0 for g in scheduler_tier.groups)

    ctl.free()  # a second free is a no-op
    assert ctl.host_bytes == 0
    assert [b.host_frees for b in backends] == ([1, 1] if swap else [0, 0])


def test_release_host_tier_is_once_and_a_freed_tier_takes_no_copy():
    ctl, _ = controller(False, "eviction")
    storage = ctl.storage
    assert host_memory.host_bytes(storage) == TIER_PAGES * 2 * PAGE
    assert host_memory.release_host_tier(storage) == TIER_PAGES * 2 * PAGE
    assert host_memory.release_host_tier(storage) == 0  # once
    assert host_memory.host_bytes(storage) == 0
    assert storage.tier_pages is None
    step = ctl.scheduler.schedule(["a"], [16])
    i32 = np.array([1], dtype=np.int32)
    offload = PageCopy("kv", i32, i32, owners=np.array([7], dtype=np.int64))
    with pytest.raises(WorkerRefusedError, match="no host tier pages"):
        storage.run(dataclasses.replace(step.effects, offloads=(offload,)))  # nothing moves
    assert storage.next_step == step.step_id  # refused: the step was not applied
    ctl.free()
    assert ctl.host_bytes == 0


def test_an_interrupt_during_free_still_lets_go_of_every_host_byte(monkeypatch):
    """``free()`` resets the tier's index after the pages are let go of; a
    ``KeyboardInterrupt`` there propagates, and the controller is freed all the same."""
    ctl, backends = controller(True, "eviction")
    tier = ctl.host_tier

    def interrupted() -> int:
        raise KeyboardInterrupt

    monkeypatch.setattr(tier, "reset", interrupted)
    with pytest.raises(KeyboardInterrupt):
        ctl.free()
    assert ctl.closed and ctl.host_bytes == 0
    assert host_memory.tier_pages_of(ctl.storage) is None
    assert [b.host_frees for b in backends] == [1, 1]
    ctl.free()  # the second call is the no-op it always is
    assert [b.host_frees for b in backends] == [1, 1]


def test_an_interrupted_free_never_frees_a_backends_host_views_twice():
    """Two backends; the first one's ``free_host_kv_cache`` is interrupted: the second
    ``free`` finishes the job without handing any backend its views again."""
    calls: list[int] = []

    class Counting(GQABackend):
        def free_host_kv_cache(self, host_caches):
            calls.append(id(self))
            if len(calls) == 1:
                raise KeyboardInterrupt
            return super().free_host_kv_cache(host_caches)

    a, b = Counting(2, 8, block_size=16), Counting(2, 8, block_size=16, sliding_window=32)
    ctl = CacheController({0: a, 1: b})
    ctl.initialize_kv_cache(num_blocks=8, max_num_seqs=2, max_model_len=64)
    ctl.initialize_host_cache(num_pages=8)
    with pytest.raises(KeyboardInterrupt):
        ctl.free()
    ctl.free()
    assert len(calls) == len(set(calls)) and ctl.host_bytes == 0
