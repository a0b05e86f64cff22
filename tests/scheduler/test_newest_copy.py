"""The newest copy of a cached key wins.

A request that recomputes a prefix (no match was offered, or the match stopped short) writes a
second copy of blocks the cache already holds under the same keys. LRU should follow the
copy used most recently, so:

- a recomputed block takes over a key whose cached copy is evictable; the old copy goes back
  to the free stack at once (it can never be served again);
- while the cached copy is in use, the recomputed one waits; when the cached copy goes
  (evicted, or written again by a truncation), the waiting copy takes the key over, holding
  the same bytes, so a later prompt still hits.
"""

from __future__ import annotations

import numpy as np

from kvforge import CacheController, GQABackend, PrefixQuery
from kvforge.verify import token_seeds, verify_request, write_step

B = 16


def controller(num_blocks: int = 40) -> CacheController:
    ctl = CacheController({0: GQABackend(1, 8, B)}, enable_prefix_caching=True)
    ctl.initialize_kv_cache(num_blocks=num_blocks, max_num_seqs=4, max_model_len=256)
    return ctl


PROMPT = np.random.default_rng(3).integers(0, 30_000, 64).tolist()  # 4 complete blocks


def compute(ctl: CacheController, rid: str, prompt: list[int], match=None) -> None:
    """One prefill step of ``prompt`` (after ``match``), written with prefix-derived seeds."""
    hit = match.num_tokens if match is not None else 0
    step = ctl.schedule(
        [rid], [len(prompt) - hit], new_token_ids=[prompt[hit:]], prefix_matches=[match]
    )
    assert not step.allocation.refused
    write_step(ctl, step, {rid: token_seeds(prompt)})
    ctl.end_step(step)


def keys_of(ctl: CacheController, prompt: list[int]) -> list[bytes]:
    [match] = ctl.lookup([PrefixQuery([*prompt, 1])])
    return list(match.keys["kv"])


def test_a_recomputed_block_takes_over_a_key_whose_copy_is_evictable():
    ctl = controller()
    compute(ctl, "a", PROMPT)
    keys = keys_of(ctl, PROMPT)
    old = [ctl.scheduler.cached_block("kv", k) for k in keys]
    ctl.free_request("a")
    pool = ctl.scheduler.pool("kv")
    assert pool.num_evictable == 4
    ctl.scheduler.take_events()
    compute(ctl, "b", PROMPT)  # recomputed: no match offered
    new = ctl.block_table("b", "kv")
    assert [ctl.scheduler.cached_block("kv", k) for k in keys] == new
    assert not set(old) & set(new)
    # the old copies went back to the free stack; nothing is evictable while b holds its own
    assert pool.num_evictable == 0
    assert ctl.num_free_blocks("kv") == 39 - 4
    events = ctl.scheduler.take_events()
    assert [(e.kind, e.num_tokens) for e in events] == [
        ("removed", 16),
        ("stored", 16),
        ("removed", 32),
        ("stored", 32),
        ("removed", 48),
        ("stored", 48),
        ("removed", 64),
        ("stored", 64),
    ]
    # LRU follows the new copy: a later prompt is served from b's blocks, bytes intact
    [match] = ctl.lookup([PrefixQuery([*PROMPT, 5])])
    assert match.blocks["kv"].tolist() == new
    compute(ctl, "c", [*PROMPT, 5], match)
    assert verify_request(ctl, "c", token_seeds([*PROMPT, 5])).mismatched == 0


def test_a_copy_computed_while_the_cached_one_is_in_use_takes_over_when_it_goes():
    ctl = controller()
    compute(ctl, "a", PROMPT)
    keys = keys_of(ctl, PROMPT)
    a_blocks = ctl.block_table("a", "kv")
    compute(ctl, "b", PROMPT)  # a still holds the cached copy: b's copy waits
    b_blocks = ctl.block_table("b", "kv")
    assert [ctl.scheduler.cached_block("kv", k) for k in keys] == a_blocks
    assert ctl.scheduler.registered_blocks("kv").keys() == set(a_blocks)
    ctl.free_request("a")  # a's copy is evictable now, b's is still in use
    pool = ctl.scheduler.pool("kv")
    assert pool.num_evictable == 4
    ctl.scheduler.take_events()
    evicted = pool.evict(4)  # memory pressure takes a's copy
    assert sorted(evicted.tolist()) == sorted(a_blocks)
    assert [ctl.scheduler.cached_block("kv", k) for k in keys] == b_blocks
    assert [e.kind for e in ctl.scheduler.take_events()] == ["removed", "stored"] * 4
    # the key lived on in b's copy: a new prompt hits it, reading b's bytes
    [match] = ctl.lookup([PrefixQuery([*PROMPT, 7])])
    assert match.num_tokens == 64 and match.blocks["kv"].tolist() == b_blocks
    compute(ctl, "c", [*PROMPT, 7], match)
    assert verify_request(ctl, "c", token_seeds([*PROMPT, 7])).mismatched == 0
    for rid in ("b", "c"):
        ctl.free_request(rid)
    assert ctl.scheduler.reset_prefix_cache() == 4  # b's copies (c's fifth is not complete)
    assert ctl.num_used_blocks("kv") == 0 and pool.num_evictable == 0


def test_a_waiting_copy_takes_over_when_the_cached_one_is_written_again():
    ctl = controller()
    compute(ctl, "a", PROMPT)
    keys = keys_of(ctl, PROMPT)
    compute(ctl, "b", PROMPT)
    b_blocks = ctl.block_table("b", "kv")
    ctl.truncate("a", 50)  # a writes into its fourth block again: its key goes
    assert ctl.scheduler.cached_block("kv", keys[3]) == b_blocks[3]
    assert [ctl.scheduler.cached_block("kv", k) for k in keys[:3]] != b_blocks[:3]


def test_a_waiting_copy_released_and_evicted_first_is_simply_dropped():
    ctl = controller()
    compute(ctl, "a", PROMPT)
    keys = keys_of(ctl, PROMPT)
    a_blocks = ctl.block_table("a", "kv")
    compute(ctl, "b", PROMPT)
    b_blocks = ctl.block_table("b", "kv")
    ctl.free_request("b")  # b's waiting copy is evictable, a's cached copy still in use
    pool = ctl.scheduler.pool("kv")
    assert pool.num_evictable == 4
    ctl.scheduler.take_events()
    assert sorted(pool.evict(4).tolist()) == sorted(b_blocks)
    assert ctl.scheduler.take_events() == []  # never announced, nothing to remove
    assert [ctl.scheduler.cached_block("kv", k) for k in keys] == a_blocks
    ctl.free_request("a")
    assert ctl.scheduler.reset_prefix_cache() == 4
    assert ctl.num_used_blocks("kv") == 0


def test_reset_forgets_waiting_copies_too():
    ctl = controller()
    compute(ctl, "a", PROMPT)
    compute(ctl, "b", PROMPT)
    ctl.free_request("b")  # evictable waiting copies
    assert ctl.scheduler.reset_prefix_cache() == 4
    assert ctl.scheduler.registered_blocks("kv") == {}
    ctl.free_request("a")
    assert ctl.num_used_blocks("kv") == 0 and ctl.scheduler.pool("kv").num_evictable == 0
