"""Prefix reuse across requests: keys, the boundary rule per family, sharing, eviction,
snapshots of per-request state, and the bytes a reused block holds.

Content is written with per-position seeds derived from the tokens up to each position
(``kvforge.verify.token_seeds``), so a reused block must hold exactly what recomputing its
prefix would write: ``verify_request`` with the new request's own token seeds checks it.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

from kvforge import CacheController, DeepseekV4Backend, DSABackend, GQABackend, MLABackend
from kvforge.core.layout import CacheLayout
from kvforge.core.prefix_keys import ExtraKeys, MultimodalKey, PrefixHasher
from kvforge.core.values import PrefixQuery
from kvforge.scheduler import BlockManager
from kvforge.verify import token_seeds, verify_request, write_step


def tokens(n: int, seed: int = 0, shared: np.ndarray | None = None) -> np.ndarray:
    rng = np.random.default_rng(seed)
    out = rng.integers(0, 50_000, n)
    if shared is not None:
        out[: len(shared)] = shared[:n]
    return out


def run_prompt(ctl, rid, toks, chunk=128, match=None, decode=0):
    """Prefill ``toks`` in chunks (sharing ``match``), then decode ``decode`` more tokens;
    every step's tokens are written through its slots with token-derived seeds."""
    start = match.num_tokens if match is not None else 0
    all_tokens = np.asarray(toks)
    if decode:
        all_tokens = np.concatenate([all_tokens, tokens(decode, seed=hash(rid) % 1000)])
    seeds = token_seeds(all_tokens)
    done, first = start, True
    while done < len(all_tokens):
        n = min(chunk, len(toks) - done) if done < len(toks) else 1
        step = ctl.schedule(
            [rid],
            [n],
            new_token_ids=[all_tokens[done : done + n]],
            prefix_matches=[match] if first else None,
        )
        assert not step.allocation.refused, step.allocation.refused
        n = int(step.allocation.num_new[0])  # a snapshot boundary may cut the step
        write_step(ctl, step, {rid: seeds})
        ctl.end_step(step)
        done += n
        first = False
    return seeds


def lookup(ctl, toks):
    [match] = ctl.lookup([PrefixQuery(toks)])
    return match


# ---------------------------------------------------------------------------------- keys


def test_keys_are_stable_across_processes():
    code = (
        "from kvforge.core.prefix_keys import ExtraKeys, PrefixHasher;"
        "print(PrefixHasher(ExtraKeys(cache_salt='salt'), unit=8).extend(list(range(40)))[-1].hex())"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    here = PrefixHasher(ExtraKeys(cache_salt="salt"), unit=8).extend(list(range(40)))[-1]
    assert out.stdout.strip() == here.hex()


def test_keys_cover_the_whole_prefix_and_the_extra_keys():
    base = PrefixHasher(unit=2).extend([5, 6, 7, 8])
    assert PrefixHasher(unit=2).extend([9, 6, 7, 8])[1] != base[1]  # an earlier token differs
    assert PrefixHasher(ExtraKeys(adapter="a-1"), unit=2).extend([5, 6, 7, 8])[0] != base[0]
    item = MultimodalKey(2, 4, bytes(32))
    image = PrefixHasher(mm_keys=[item], unit=2).extend([5, 6, 7, 8])
    assert image[0] == base[0] and image[1] != base[1]  # only prefixes through the image
    other = PrefixHasher(mm_keys=[MultimodalKey(2, 4, bytes(31) + b"x")], unit=2)
    assert other.extend([5, 6, 7, 8])[1] != image[1]  # same placeholder ids, other content


# ---------------------------------------------------------------------------------- full groups


@pytest.mark.parametrize(
    "backend",
    [GQABackend(2, 16, 16), MLABackend(block_size=16), DSABackend(block_size=64)],
    ids=["gqa", "mla", "dsa"],
)
def test_history_hit_shares_blocks_and_reused_bytes_match(backend):
    ctl = CacheController({0: backend, 1: backend}, enable_prefix_caching=True)
    ctl.initialize_kv_cache(num_blocks=64)
    bs = ctl.layout.groups[0].block_size
    a = tokens(5 * bs + 3)
    run_prompt(ctl, "a", a)
    a_table = ctl.block_table("a", "kv")
    ctl.free_request("a")
    assert ctl.num_used_blocks("kv") == 0  # cached, evictable, counted free
    b = tokens(8 * bs, seed=1, shared=a[: 4 * bs + 5])
    match = lookup(ctl, b)
    assert match.num_tokens == 4 * bs  # the chain matches through 4 whole blocks
    seeds = run_prompt(ctl, "b", b, match=match)
    assert ctl.block_table("b", "kv")[:4] == a_table[:4]  # shared, not copied
    check = verify_request(ctl, "b", seeds)
    assert check.mismatched == 0 and check.entries == 2 * len(ctl.layout.buffers) // 2 * 8 * bs
    # the last token is always computed: a whole identical prompt matches one block less
    assert lookup(ctl, b[: 8 * bs]).num_tokens == 7 * bs
    ctl.free_request("b")
    assert ctl.num_used_blocks("kv") == 0
    stats = ctl.prefix_stats
    assert stats.hit_tokens == 4 * bs + 7 * bs and stats.queries == 2


def test_a_match_never_crosses_a_missing_block_and_eviction_is_deepest_first():
    ctl = CacheController({0: GQABackend(1, 8, 16)}, enable_prefix_caching=True)
    ctl.initialize_kv_cache(num_blocks=9)  # 8 usable
    a = tokens(96)  # 6 blocks
    run_prompt(ctl, "a", a)
    ctl.free_request("a")
    ctl.scheduler.take_events()
    run_prompt(ctl, "x", tokens(48, seed=9))  # 3 blocks: 2 free + 1 evicted
    removed = [e for e in ctl.scheduler.take_events() if e.kind == "removed"]
    assert [e.num_tokens for e in removed] == [96]  # the deepest block of the chain first
    assert lookup(ctl, tokens(200, shared=a)).num_tokens == 80
    assert ctl.prefix_stats.evictions == {"history": 1}


# ---------------------------------------------------------------------------------- windows


def test_sliding_window_needs_only_its_tail():
    # window 32, block 16: a match at L needs the blocks of tokens [L + 1 - 32, L)
    ctl = CacheController({0: GQABackend(1, 8, 16, sliding_window=32)}, enable_prefix_caching=True)
    ctl.initialize_kv_cache(num_blocks=40)
    a = tokens(200)
    run_prompt(ctl, "a", a, chunk=16)
    ctl.free_request("a")
    b = tokens(300, seed=3, shared=a[:170])
    match = lookup(ctl, b)
    assert match.num_tokens == 160
    assert match.first_col == {"swa": 8}  # tokens 129..159 -> blocks 8 and 9
    assert len(match.blocks["swa"]) == 2
    seeds = run_prompt(ctl, "b", b, match=match)
    assert verify_request(ctl, "b", seeds).mismatched == 0


@pytest.mark.slow
def test_deepseek_v4_worked_example():
    # the example of BlockManager.lookup's docstring: 1,000 tokens, the first 768 cached
    backends = {0: DeepseekV4Backend(0), 1: DeepseekV4Backend(4), 2: DeepseekV4Backend(128)}
    ctl = CacheController(backends, enable_prefix_caching=True)
    ctl.initialize_kv_cache(
        num_blocks={"swa": 40, "compressed": 12, "c4_state": 600, "c128_state": 300}
    )
    a = tokens(900)
    run_prompt(ctl, "a", a)
    ctl.free_request("a")
    b = tokens(1000, seed=1, shared=a[:800])
    match = lookup(ctl, b)
    assert match.num_tokens == 768  # LCM of 64, 256, 4, 8 is 256: 768 <= 800
    assert match.first_col == {"swa": 10, "compressed": 0, "c4_state": 190, "c128_state": 80}
    assert {g: len(ids) for g, ids in match.blocks.items()} == {
        "swa": 2,  # tokens 641..767 -> blocks 10, 11 of 64
        "compressed": 3,  # tokens 0..767 -> blocks 0..2 of 256
        "c4_state": 2,  # tokens 761..767 -> blocks 190, 191 of 4
        "c128_state": 16,  # tokens 641..767 -> blocks 80..95 of 8
    }
    seeds = run_prompt(ctl, "b", b, match=match)
    assert verify_request(ctl, "b", seeds).mismatched == 0
    # evicting one state tail block caps the next match at the previous boundary
    manager = ctl.scheduler
    ctl.free_request("b")
    pool = manager.pool("c4_state")
    key = match.keys["c4_state"][0]
    block = manager.cached_block("c4_state", key)
    pool.evict(block_ids=[block])
    assert lookup(ctl, b).num_tokens == 512


# ---------------------------------------------------------------------------------- lifecycle


def test_shared_blocks_survive_swaps_truncation_and_frees():
    ctl = CacheController({0: GQABackend(2, 16, 16)}, enable_prefix_caching=True)
    ctl.initialize_kv_cache(num_blocks=40)
    ctl.initialize_host_cache(num_pages=40)
    a = tokens(100)
    seeds_a = run_prompt(ctl, "a", a)
    b = tokens(120, seed=2, shared=a[:100])
    match = lookup(ctl, b)
    assert match.num_tokens == 96
    seeds_b = run_prompt(ctl, "b", b, match=match)
    shared = ctl.block_table("b", "kv")[:6]
    assert shared == ctl.block_table("a", "kv")[:6]
    ctl.swap_out("b")  # copies b's blocks out; a still holds the shared ones
    assert ctl.block_table("a", "kv")[:6] == shared
    assert verify_request(ctl, "a", seeds_a).mismatched == 0
    ctl.swap_in("b")
    assert verify_request(ctl, "b", seeds_b).mismatched == 0
    ctl.truncate("a", 97)  # a gives up only its own block 6
    assert verify_request(ctl, "a", seeds_a).mismatched == 0
    ctl.free_requests(["a", "b"])
    assert ctl.num_used_blocks("kv") == 0


def test_a_stale_match_is_refused_and_changes_nothing():
    ctl = CacheController({0: GQABackend(1, 8, 16)}, enable_prefix_caching=True)
    ctl.initialize_kv_cache(num_blocks=5)
    a = tokens(64)
    run_prompt(ctl, "a", a)
    ctl.free_request("a")
    match = lookup(ctl, tokens(80, shared=a))
    assert match.num_tokens == 64
    run_prompt(ctl, "x", tokens(64, seed=5))  # evicts a's blocks
    step = ctl.schedule(["b"], [16], prefix_matches=[match])
    assert [r.reason for r in step.allocation.refused] == ["stale_prefix"]
    assert "look it up again" in step.allocation.refused[0].message
    assert ctl.requests == ["x"] and ctl.num_used_blocks("kv") == 4


def test_reset_forgets_every_prefix():
    ctl = CacheController({0: GQABackend(1, 8, 16)}, enable_prefix_caching=True)
    ctl.initialize_kv_cache(num_blocks=20)
    a = tokens(64)
    run_prompt(ctl, "a", a)
    ctl.free_request("a")
    assert ctl.scheduler.reset_prefix_cache() == 4
    assert lookup(ctl, tokens(80, shared=a)).num_tokens == 0


def test_lookup_without_caching_and_bad_queries():
    layout = CacheLayout({0: GQABackend(1, 8, 16)})
    manager = BlockManager(layout, {"kv": 8})
    assert manager.lookup([PrefixQuery(list(range(40)))])[0].num_tokens == 0
    for bad, exc, message in [
        (PrefixQuery([1, 2]), TypeError, "queries must be a sequence of PrefixQuery"),
        ([object()], TypeError, "queries[0] is a object, not a PrefixQuery"),
        ([PrefixQuery([1.5, 2.0])], ValueError, "queries[0].token_ids must be a 1-d sequence"),
    ]:
        with pytest.raises(exc) as info:
            manager.lookup(bad)
        assert message in str(info.value)
    with pytest.raises(ValueError, match=r"snapshot_interval must be a positive multiple of 16"):
        BlockManager(layout, {"kv": 8}, snapshot_interval=24)


# ---------------------------------------------------------------------------------- snapshots


def test_linear_attention_state_is_snapshotted_at_a_boundary_and_restored():
    # Qwen3-Next-like: a linear-attention layer (one state slot per request) and a full layer
    # (block 16). Snapshots every 512 tokens (the default interval: 16 * ceil(512 / 16)).
    from kvforge.attn_backends.linear_attention import LinearAttentionBackend
    from kvforge.verify import entry_bytes_for, read_entries, write_entries

    linear = LinearAttentionBackend(2, 2, 8, 8, 4)
    ctl = CacheController({0: linear, 1: GQABackend(1, 8, 16)}, enable_prefix_caching=True)
    ctl.initialize_kv_cache(num_blocks={"linear_state": 8, "kv": 80})
    state = [e for e in ctl.layout.buffers if e.group.name == "linear_state"]

    def write_state(rid, seeds, n):  # the state after n tokens is a function of the prefix
        slot = ctl.block_table(rid, "linear_state")
        for e in state:
            data = entry_bytes_for(seeds, e, torch.tensor([n - 1]), e.role.entry_bytes)
            write_entries(ctl.get(e.role.name, e.layer), e, torch.tensor(slot), data)

    def read_state(rid):
        slot = ctl.block_table(rid, "linear_state")
        return [read_entries(ctl.get(e.role.name, e.layer), e, torch.tensor(slot)) for e in state]

    a = tokens(600)
    seeds_a = token_seeds(a)
    done, sizes = 0, []
    while done < 600:
        step = ctl.schedule(["a"], [min(128, 600 - done)], new_token_ids=[a[done : done + 128]])
        n = int(step.allocation.num_new[0])
        sizes.append(n)
        write_step(ctl, step, {"a": seeds_a})
        write_state("a", seeds_a, done + n)
        ctl.end_step(step)  # the snapshot copy runs after the step's kernels
        if done + n == 512:
            at_512 = read_state("a")
        done += n
    assert sizes == [128, 128, 128, 128, 88]  # 384 + 128 ends exactly on 512
    ctl.free_request("a")
    b = tokens(700, seed=4, shared=a[:600])
    match = lookup(ctl, b)
    assert match.num_tokens == 512  # the only snapshot, although 592 tokens of history match
    step = ctl.schedule(["b"], [64], new_token_ids=[b[512:576]], prefix_matches=[match])
    assert [c.group for c in step.allocation.copies_before] == ["linear_state"]
    got = read_state("b")  # restored before the step's kernels
    assert all(torch.equal(x, y) for x, y in zip(got, at_512, strict=True))
    write_step(ctl, step, {"b": token_seeds(b)})
    assert verify_request(ctl, "b", token_seeds(b), skip_groups=("linear_state",)).mismatched == 0


def test_a_bad_query_in_a_batch_changes_no_counter():
    layout = CacheLayout({0: GQABackend(1, 8, 16)})
    manager = BlockManager(layout, {"kv": 8}, enable_prefix_caching=True)
    with pytest.raises(ValueError, match=r"queries\[1\].token_ids must be a 1-d sequence"):
        manager.lookup([PrefixQuery([1, 2, 3]), PrefixQuery([1.5])])
    assert manager.prefix_stats.queries == 0 and manager.prefix_stats.query_tokens == 0
