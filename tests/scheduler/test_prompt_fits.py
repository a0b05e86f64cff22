"""``BlockManager.prompt_fits``: whether a new request's whole prompt fits now, the check an
engine that admits only whole prompts asks (vLLM's ``full_sequence_must_fit``). It changes
nothing, counts a step's chunk for window groups, and credits matched blocks in use."""

from __future__ import annotations

import pytest

from kvforge import GQABackend
from kvforge.core.arena import plan_arena
from kvforge.core.layout import CacheLayout
from kvforge.core.values import PrefixQuery
from kvforge.models import from_hf_config
from kvforge.scheduler import BlockManager


def full_manager(blocks: int = 11) -> BlockManager:
    layout = CacheLayout({0: GQABackend(1, 8, block_size=16)})
    return BlockManager(layout, {"kv": blocks}, 4, 1024, enable_prefix_caching=True)


def window_manager() -> BlockManager:
    layout = CacheLayout({0: GQABackend(1, 8, block_size=16, sliding_window=32)})
    return BlockManager(layout, {"swa": 9}, 4, 1024)


# (manager, prompt tokens, chunk, fits): 10 usable blocks of 16 tokens in the full pool; the
# window group holds cdiv(32, 16) + 1 = 3 blocks at rest plus a chunk's blocks
CASES = [
    ("full", 160, 64, True),  # 10 blocks
    ("full", 161, 64, False),  # 11 blocks
    ("window", 4096, 64, True),  # 3 + 4 = 7 <= 8 usable
    ("window", 4096, 96, False),  # 3 + 6 = 9 > 8 usable
    ("window", 64, 512, True),  # never more than the prompt's own 4 blocks
]


@pytest.mark.parametrize(("kind", "tokens", "chunk", "fits"), CASES)
def test_whole_prompt_fits_or_not(kind, tokens, chunk, fits) -> None:
    m = full_manager() if kind == "full" else window_manager()
    group = m.groups[0]
    free = m.num_free_blocks(group)
    assert m.prompt_fits(tokens, chunk) is fits
    assert m.num_free_blocks(group) == free and m.requests == []


def test_blocks_a_match_shares_in_use_cost_nothing_more() -> None:
    m = full_manager()
    tokens = list(range(1, 129))  # 8 blocks
    step = m.schedule(["a"], [128], [tokens])
    m.end_step(step)
    [match] = m.lookup([PrefixQuery(tokens + [7] * 32)])
    assert match.num_tokens == 128  # the 8 blocks 'a' holds
    assert m.num_free_blocks("kv") == 2
    assert not m.prompt_fits(160, 64)  # 10 blocks, 2 free
    assert m.prompt_fits(160, 64, match)  # 10 - 8 in use = 2
    assert not m.prompt_fits(176, 64, match)  # 11 - 8 = 3
    m.finish(["a"])  # now the matched blocks are evictable: free, and no credit
    assert m.num_free_blocks("kv") == 10
    assert m.prompt_fits(160, 64, match) and not m.prompt_fits(176, 64, match)


def test_the_arena_counts_every_group_together() -> None:
    layout = CacheLayout(from_hf_config("deepseek-v4-tiny"))
    arena = plan_arena(layout, 64 << 20)
    blocks = {g: arena.num_blocks(g) for g in arena.groups}
    m = BlockManager(layout, blocks, 4, 65536, arena=arena)
    assert m.prompt_fits(2048, 512)
    assert not m.prompt_fits(65536, 8192)
    assert m.arena.moves == 0 and (m.arena.owner[1 : arena.num_slabs] == -1).all()


BAD = [
    ((0, 64), ValueError, "num_tokens must be an int >= 1, got 0"),
    ((16, 0), ValueError, "chunk must be an int >= 1, got 0"),
    (("16", 64), TypeError, "num_tokens must be an int"),
]


@pytest.mark.parametrize(("args", "error", "message"), BAD)
def test_bad_arguments_refused(args, error, message) -> None:
    m = full_manager()
    with pytest.raises(error, match=message):
        m.prompt_fits(*args)
    assert m.num_free_blocks("kv") == 10
