"""The host tier's worker side: ``HostTierPages.move`` keeps device blocks in host
tier pages (one gather per copy) and brings them back into other device blocks (one scatter)
byte for byte, runs offloads before onloads, and refuses a forged or malformed copy before
moving a byte. The pages are a pool of their own, apart from the swap pages."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvforge import GQABackend
from kvforge.core.layout import CacheLayout
from kvforge.core.values import BlockCopy, PageCopy
from kvforge.errors import BlockRangeError, ControllerClosedError, WorkerRefusedError
from kvforge.scheduler.host_tier import HostTier
from kvforge.scheduler.unit_records import UnitRecordStore
from kvforge.worker import CacheStorage
from kvforge.worker.tier_pages import HostTierPages


def layout() -> CacheLayout:
    swa = GQABackend(2, 8, block_size=16, sliding_window=32)
    kv = GQABackend(2, 8, block_size=16)
    return CacheLayout({0: swa, 1: kv, 2: swa, 3: kv})


def storage(tier_pages: int = 6) -> tuple[CacheStorage, HostTierPages]:
    s = CacheStorage(layout())
    s.create({"swa": 10, "kv": 10}, max_num_seqs=4, max_model_len=256, share_pools=False)
    tier = HostTierPages(s, {"swa": tier_pages, "kv": tier_pages})
    for t in s.kv_caches:
        t.copy_(torch.randn(t.shape, generator=torch.Generator().manual_seed(t.numel())))
    return s, tier


def blocks(s: CacheStorage, group: str, ids: list[int]) -> list[torch.Tensor]:
    return [s.kv_caches[e.index][ids].clone() for e in s.layout.buffers_of(group)]


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(
        torch.equal(x.view(torch.uint8), y.view(torch.uint8)) for x, y in zip(a, b, strict=True)
    )


def copy(group: str, device: list[int], pages: list[int], seq: int = 0) -> PageCopy:
    """A copy numbered ``seq`` in its tier's sequence; page ``p`` holds key tag ``1000 + p``
    (what a tier's offload writes and its onload reads back)."""
    return PageCopy(
        group,
        np.array(device, dtype=np.int32),
        np.array(pages, dtype=np.int32),
        owners=np.array([1000 + p for p in pages], dtype=np.int64),
        seq=seq,
    )


def test_offload_then_onload_into_other_blocks_is_byte_identical():
    s, tier = storage()
    kept = {g: blocks(s, g, [1, 2, 3]) for g in ("kv", "swa")}
    out = [copy("kv", [1, 2, 3], [3, 1, 2], 0), copy("swa", [1, 2, 3], [1, 2, 3], 1)]
    assert tier.move(out) is None
    for t in s.kv_caches:  # the device blocks are written again
        t[1:4].zero_()
    tier.move(onloads=[copy("kv", [7, 8, 9], [3, 1, 2], 2), copy("swa", [4, 5, 6], [1, 2, 3], 3)])
    assert same(blocks(s, "kv", [7, 8, 9]), kept["kv"])
    assert same(blocks(s, "swa", [4, 5, 6]), kept["swa"])
    # the tier's pages are not the swap pages
    assert tier.groups["kv"].pages.shape == (6, layout().host_page_bytes("kv"))
    assert not s.host_ready


def test_offloads_run_before_onloads_in_one_batch():
    s, tier = storage()
    want = blocks(s, "kv", [5])
    tier.move(offloads=[copy("kv", [5], [4], 0)], onloads=[copy("kv", [6], [4], 1)])
    assert same(blocks(s, "kv", [6]), want)


def test_the_scheduler_sides_copies_round_trip_through_the_worker():
    s, tier = storage(tier_pages=3)  # two usable pages: the third demotion evicts the first
    t = HostTier({"kv": 3, "swa": 3}, UnitRecordStore())
    kept = blocks(s, "kv", [1, 2, 3])
    for i, b in enumerate([1, 2]):
        t.demote("kv", bytes([i + 1]) * 32, 16 * (i + 1), b)
    tier.move(t.take_offloads())
    t.demote("kv", b"\x03" * 32, 48, 3)  # evicts key 1's page
    tier.move(t.take_offloads())
    for c in s.kv_caches:
        c[1:4].zero_()
    assert t.reach([{"kv": [b"\x01" * 32]}]) == 0  # a shorter hit, never other bytes
    assert t.reach([{"kv": [b"\x02" * 32]}, {"kv": [b"\x03" * 32]}]) == 2
    t.onload({"kv": ([b"\x02" * 32, b"\x03" * 32], [8, 9])})
    tier.move(onloads=t.take_onloads())
    assert same(blocks(s, "kv", [8, 9]), [x[1:] for x in kept])


FORGED = [
    (
        {"offloads": [copy("kv", [10], [1])]},
        BlockRangeError,
        r"block id 10 of group 'kv' is outside \[1, 10\)",
    ),
    (
        {"offloads": [copy("kv", [0], [1])]},
        BlockRangeError,
        r"block id 0 .*\(0 is the null block\)",
    ),
    ({"offloads": [copy("kv", [-1], [1])]}, BlockRangeError, "block id -1"),
    (
        {"offloads": [copy("kv", [1], [6])]},
        BlockRangeError,
        r"host page 6 of group 'kv' is outside \[1, 6\)",
    ),
    ({"onloads": [copy("kv", [1], [0])]}, BlockRangeError, r"host page 0 .*\(0 is the null page\)"),
    ({"onloads": [copy("kv", [1, 1], [1, 2])]}, WorkerRefusedError, "write a device block twice"),
    (
        {"onloads": [copy("kv", [1], [1]), copy("kv", [1], [2])]},
        WorkerRefusedError,
        "write a device block twice",
    ),
    (
        {"onloads": [copy("kv", [1, 2], [1])]},
        WorkerRefusedError,
        "names 2 device blocks and 1 host pages",
    ),
    (
        {"onloads": [copy("nope", [1], [1])]},
        WorkerRefusedError,
        "group 'nope', which has no host tier pages",
    ),
    (
        {"onloads": [BlockCopy("kv", np.array([1], np.int32), np.array([2], np.int32))]},
        WorkerRefusedError,
        "expected PageCopy values, got BlockCopy",
    ),
    (
        {"onloads": copy("kv", [1], [1])},
        WorkerRefusedError,
        "onloads must be a sequence of PageCopy",
    ),
    (
        {"offloads": [PageCopy("kv", np.array([1.0]), np.array([1]))]},
        WorkerRefusedError,
        "device_blocks must be a 1-d integer array",
    ),
    # a valid offload first: the whole batch is refused, nothing moved
    (
        {"offloads": [copy("kv", [1], [1])], "onloads": [copy("kv", [2], [9])]},
        BlockRangeError,
        "host page 9",
    ),
]


@pytest.mark.parametrize(("kwargs", "error", "message"), FORGED)
def test_a_forged_copy_is_refused_before_a_byte_moves(kwargs, error, message):
    s, tier = storage()
    before = [t.clone() for t in s.kv_caches]
    pages = {g: p.pages.clone() for g, p in tier.groups.items()}
    with pytest.raises(error, match=message):
        tier.move(**kwargs)
    assert all(torch.equal(a, b) for a, b in zip(before, s.kv_caches, strict=True))
    assert all(torch.equal(pages[g], p.pages) for g, p in tier.groups.items())


def test_pages_are_for_groups_the_storage_holds_and_a_freed_storage_moves_nothing():
    s = CacheStorage(layout())
    with pytest.raises(RuntimeError, match="call initialize_kv_cache"):
        HostTierPages(s, {"kv": 4})
    s.create({"swa": 10, "kv": 10}, max_num_seqs=4, max_model_len=256, share_pools=False)
    with pytest.raises(ValueError, match=r"names groups \['nope'\]"):
        HostTierPages(s, {"nope": 4})
    with pytest.raises(ValueError, match=r"num_pages\['kv'\] must be an int >= 2"):
        HostTierPages(s, {"kv": 1})
    tier = HostTierPages(s, {"kv": 4})
    assert tier.num_pages == {"kv": 4}
    assert tier.nbytes == 4 * layout().host_page_bytes("kv")
    with pytest.raises(WorkerRefusedError, match="group 'swa', which has no host tier pages"):
        tier.move([copy("swa", [1], [1])])
    s.free()
    with pytest.raises(ControllerClosedError):
        tier.move([copy("kv", [1], [1])])


def test_the_arena_round_trips_unpadded_pages_and_refuses_an_onload_into_another_slab():
    from kvforge import CacheController
    from kvforge.errors import BlockOwnershipError
    from kvforge.models import from_hf_config

    ctl = CacheController(from_hf_config("deepseek-v4-tiny"), enable_prefix_caching=True)
    ctl.initialize_kv_cache(
        memory_budget=96 << 20, max_num_seqs=6, max_model_len=4096, max_num_batched_tokens=512
    )
    s, arena = ctl.storage, ctl.storage.arena
    assert arena is not None
    tier = HostTierPages(s, {g: 4 for g in arena.groups})
    for g in arena.groups:  # pages hold the meaningful bytes only, not the padded stride
        assert tier.groups[g].pages.shape[1] == ctl.layout.host_page_bytes(g)
    step = ctl.schedule(["a"], [300], new_token_ids=[np.arange(1, 301)])
    ctl.end_step(step)
    full = ctl.block_table("a", "compressed")[0]
    caches = [s.kv_caches[e.index] for e in s.layout.buffers_of("compressed")]
    for t in caches:
        t[full].copy_(torch.randn(t[full].shape).to(t.dtype))
    want = [t[full].clone() for t in caches]
    tier.move([copy("compressed", [full], [1], 0)])
    k_full = arena.blocks_per_slab[arena.groups.index("compressed")]
    k_swa = arena.blocks_per_slab[arena.groups.index("swa")]
    window = np.asarray(ctl.block_table("a", "swa"))
    forged = window[window != 0][0] // k_swa * k_full + 1  # compressed, in swa's slab
    with pytest.raises(BlockOwnershipError, match=r"lies in slab .* of the arena"):
        tier.move(onloads=[copy("compressed", [forged], [1], 1)])
    # an onload never writes a block a row holds: not even back into request a's own block
    with pytest.raises(BlockOwnershipError, match=r"an onload writes block .* which row 0"):
        tier.move(onloads=[copy("compressed", [full], [1], 1)])
    tier.move([copy("compressed", [forged], [2], 1)])  # reading it is no write: allowed
    for t in caches:
        t[full].zero_()
    ctl.free_request("a")  # row 0 lets go of the block; the prefix cache still keeps it
    tier.move(onloads=[copy("compressed", [full], [1], 2)])
    assert same([t[full].clone() for t in caches], want)


# ------------------------------------------------------------------ wired: demotion


def gqa_controller(num_blocks: int = 24, pages: int = 32):
    from kvforge import CacheController

    swa = GQABackend(2, 8, block_size=16, sliding_window=32)
    kv = GQABackend(2, 8, block_size=16)
    ctl = CacheController({0: swa, 1: kv, 2: swa, 3: kv}, enable_prefix_caching=True)
    ctl.initialize_kv_cache(num_blocks=num_blocks, max_num_seqs=2, max_model_len=512)
    assert ctl.initialize_host_tier(num_pages=pages) == {"swa": pages, "kv": pages}
    return ctl


def page_bytes(ctl, group: str, block: int) -> torch.Tensor:
    """What a host page of ``block`` holds: its offloaded buffers' bytes, packed in order."""
    caches = ctl.kv_caches
    return torch.cat(
        [
            caches[e.index][block].contiguous().view(torch.uint8).flatten()
            for e in ctl.layout.offload_buffers(group)
        ]
    )


def run_prompt(ctl, rid: str, toks: np.ndarray, chunk: int = 64, seen=None):
    """Prefill ``toks`` in chunks, writing every token's bytes; with ``seen``, collect the
    bytes of every block the device prefix cache holds after each step (a key's bytes never
    change while it is cached, and window blocks may go within the prompt)."""
    from kvforge.verify import token_seeds, write_step

    seeds = token_seeds(toks)
    done = 0
    while done < len(toks):
        n = min(chunk, len(toks) - done)
        step = ctl.schedule([rid], [n], new_token_ids=[toks[done : done + n]])
        assert not step.allocation.refused, step.allocation.refused
        write_step(ctl, step, {rid: seeds})
        ctl.end_step(step)
        if seen is not None:
            seen.update(cached_bytes(ctl))
        done += n
    return seeds


def cached_bytes(ctl) -> dict[tuple[str, bytes], torch.Tensor]:
    """(group, key) -> the page bytes of every block the device prefix cache holds."""
    out = {}
    for group in ctl.groups:
        for block, (key, _, g) in ctl.scheduler.registered_blocks(group).items():
            out[(g, key)] = page_bytes(ctl, g, block)
    return out


def test_evicted_prefix_blocks_land_in_host_pages_byte_for_byte():
    ctl = gqa_controller()
    toks = np.arange(1, 129)
    before: dict[tuple[str, bytes], torch.Tensor] = {}
    run_prompt(ctl, "a", toks, seen=before)
    assert {g for g, _ in before} == {"swa", "kv"}
    cached_a = set(before)
    ctl.free_request("a")
    records = ctl.scheduler._prefix.records
    from kvforge.core.prefix_keys import PrefixHasher

    h = PrefixHasher(unit=ctl.scheduler.prefix_unit)
    h.extend(toks)
    run_prompt(ctl, "b", np.arange(1000, 1224), seen=before)  # a's cached blocks go
    tier, pages = ctl.host_tier, ctl.storage.tier_pages
    demoted = {k: v for k, v in before.items() if tier.page_of(*k) is not None}
    assert len(demoted) == len(tier) == sum(tier.stats.demotions.values()) > 0
    assert {g for g, _ in demoted} == {"swa", "kv"}
    assert sum(1 for _, k in demoted if k in {k for _, k in cached_a}) >= 8  # a's chain
    for (group, key), want in demoted.items():
        got = pages.groups[group].pages[tier.page_of(group, key)]
        assert torch.equal(got, want), (group, key.hex()[:8])
    # the exact check's records live on with the pages although the device forgot the keys
    assert not any(ctl.scheduler.cached_block(g, k) for g, k in demoted)
    assert records.confirm(h.unit_records()) == len(toks) // ctl.scheduler.prefix_unit
    # reset forgets the host tier too
    ctl.scheduler.reset_prefix_cache()
    assert len(tier) == 0 and tier.pool("kv").num_free == tier.pool("kv").num_usable


def test_a_step_with_forged_offloads_is_refused_before_anything_is_mirrored():
    import dataclasses

    ctl = gqa_controller()
    run_prompt(ctl, "a", np.arange(1, 129))
    ctl.free_request("a")
    manager, storage = ctl.scheduler, ctl.storage
    alloc = manager.schedule(["b"], [64], new_token_ids=[np.arange(500, 564)])
    seq = storage.next_seq
    forged = dataclasses.replace(alloc, offloads=(copy("kv", [1], [999]),))
    with pytest.raises(BlockRangeError, match="host page 999"):
        storage.apply(forged)
    assert storage.next_seq == seq  # nothing mirrored
    storage.apply(alloc)
    assert storage.next_seq > seq
    manager.end_step(alloc)


def test_a_worker_without_host_tier_pages_refuses_offloads():
    import dataclasses

    from kvforge import CacheController

    ctl = CacheController({0: GQABackend(2, 8, block_size=16)}, enable_prefix_caching=True)
    ctl.initialize_kv_cache(num_blocks=8, max_num_seqs=2, max_model_len=64)
    alloc = ctl.scheduler.schedule(["a"], [16], new_token_ids=[np.arange(16)])
    with pytest.raises(WorkerRefusedError, match="has no host tier pages"):
        ctl.storage.apply(dataclasses.replace(alloc, offloads=(copy("kv", [1], [1]),)))


@pytest.mark.slow
def test_the_arena_demotes_what_slab_moves_and_takes_evict():
    from kvforge import CacheController
    from kvforge.models import from_hf_config

    ctl = CacheController(from_hf_config("deepseek-v4-tiny"), enable_prefix_caching=True)
    ctl.initialize_kv_cache(
        memory_budget=96 << 20, max_num_seqs=6, max_model_len=4096, max_num_batched_tokens=512
    )
    assert ctl.storage.arena is not None
    ctl.initialize_host_tier(num_pages=4096)
    seen: dict[tuple[str, bytes], torch.Tensor] = {}
    rng = np.random.default_rng(0)
    for i in range(8):
        run_prompt(ctl, f"r{i}", rng.integers(1, 30000, 1536), chunk=512, seen=seen)
        ctl.free_request(f"r{i}")
    tier, pages = ctl.host_tier, ctl.storage.tier_pages
    demoted = [k for k in seen if tier.page_of(*k) is not None]
    assert len({g for g, _ in demoted}) >= 2, tier.stats
    for group, key in demoted:
        got = pages.groups[group].pages[tier.page_of(group, key)]
        assert torch.equal(got, seen[(group, key)]), group


def test_the_controller_offloads_a_truncations_eviction_before_its_copy_writes():
    from kvforge import CacheController
    from kvforge.core.values import PrefixQuery
    from kvforge.verify import token_seeds, write_step

    ctl = CacheController({0: GQABackend(2, 8, block_size=16)}, enable_prefix_caching=True)
    ctl.initialize_kv_cache(num_blocks=6, max_num_seqs=4, max_model_len=64)  # 5 usable
    ctl.initialize_host_tier(num_pages=8)
    seen: dict[tuple[str, bytes], torch.Tensor] = {}
    run_prompt(ctl, "z", np.arange(900, 932), seen=seen)
    ctl.free_request("z")
    run_prompt(ctl, "a", np.arange(40), seen=seen)
    ctl.free_request("a")
    for rid in ("c", "d"):  # both share a's 2 cached blocks; d's block evicts z's deepest
        [match] = ctl.lookup([PrefixQuery(np.arange(40))])
        step = ctl.schedule([rid], [8], new_token_ids=[np.arange(32, 40)], prefix_matches=[match])
        write_step(ctl, step, {rid: token_seeds(np.arange(40))})
        ctl.end_step(step)
    tier = ctl.host_tier
    assert sum(tier.stats.demotions.values()) == 1
    ctl.truncate("c", 24)  # copy on write into a fresh block: z's root is evicted first
    assert sum(tier.stats.demotions.values()) == 2
    pages = ctl.storage.tier_pages.groups["kv"].pages
    z_keys = [k for g, k in seen if tier.page_of(g, k) is not None]
    assert len(z_keys) == 2
    for key in z_keys:
        assert torch.equal(pages[tier.page_of("kv", key)], seen[("kv", key)])


BAD_TIERS = [
    (False, (4,), {}, RuntimeError, "enable_prefix_caching=True"),
    (True, (4,), {"policy": "lazy"}, ValueError, "host_tier_policy must be 'eviction'"),
    (True, (1,), {}, ValueError, r"\['kv'\] must be an int >= 2"),
    (True, ({"nope": 4},), {}, ValueError, "nope"),
]


@pytest.mark.parametrize(("prefix", "args", "kw", "error", "message"), BAD_TIERS)
def test_a_bad_initialize_host_tier_allocates_nothing(prefix, args, kw, error, message):
    from kvforge import CacheController

    ctl = CacheController({0: GQABackend(2, 8, block_size=16)}, enable_prefix_caching=prefix)
    ctl.initialize_kv_cache(num_blocks=6, max_num_seqs=2, max_model_len=64)
    with pytest.raises(error, match=message):
        ctl.initialize_host_tier(*args, **kw)
    assert ctl.storage.tier_pages is None and ctl.host_tier is None
    if prefix:
        ctl.initialize_host_tier(4)
        with pytest.raises(RuntimeError, match="host tier pages already"):
            ctl.initialize_host_tier(4)
