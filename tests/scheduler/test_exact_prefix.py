"""Prefix reuse never serves another prompt's KV: structured collisions of the old polynomial
key, extra keys that print alike, multimodal keys at block edges, and a forced collision of the
key function that the exact check turns into a counted miss."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from kvforge import GQABackend, PrefixQuery
from kvforge.core.layout import CacheLayout
from kvforge.core.prefix_keys import ExtraKeys, MultimodalKey
from kvforge.models import from_hf_config
from kvforge.scheduler import BlockManager


def thue_morse(a: int, b: int, n: int) -> list[int]:
    """``a`` where the bit count of the index is even, ``b`` where it is odd."""
    return [a if bin(i).count("1") % 2 == 0 else b for i in range(n)]


def ignores_tokens(data: bytes) -> bytes:
    """A weak key function: parent key, offset and unit size only (the first 44 bytes of a unit
    preimage), so two prompts of one length get equal keys at every unit."""
    return hashlib.sha256(data[:44]).digest()


def manager(layout: CacheLayout, longest: int, **kw) -> BlockManager:
    blocks = {g.name: 4 + 2 * -(-longest // g.block_size) for g in layout.groups}
    return BlockManager(layout, blocks, 4, longest + 64, enable_prefix_caching=True, **kw)


def serve(m: BlockManager, rid: str, tokens: list[int], extra=None, mm=()) -> None:
    [match] = m.lookup([PrefixQuery(tokens, extra, tuple(mm))])
    rest = tokens[match.num_tokens :]
    step = m.schedule([rid], [len(rest)], new_token_ids=[rest], prefix_matches=[match])
    assert step.request_ids == (rid,)
    m.end_step(step)  # the writing step ended: its blocks are shareable
    m.finish([rid])


def hit(m: BlockManager, tokens: list[int], extra=None, mm=()) -> int:
    return m.lookup([PrefixQuery(tokens, extra, tuple(mm))])[0].num_tokens


MODELS = [
    *(
        pytest.param({0: GQABackend(2, 8, bs)}, id=f"gqa-block{bs}")
        for bs in (16, 64, 128, 256, 512, 1024)
    ),
    pytest.param(from_hf_config("deepseek-v4-tiny"), id="deepseek-v4-tiny"),
]
# token pairs whose polynomial mix agreed in the low 20 bits under the old key (and others)
PAIRS = [(3, 5), (1_234, 98_765), (0, 131_071)]


@pytest.mark.parametrize("algorithm", ["sha256", "blake2b", ignores_tokens])
@pytest.mark.parametrize("backends", MODELS)
@pytest.mark.parametrize(("a", "b"), PAIRS)
def test_thue_morse_pairs_never_share(backends, a, b, algorithm):
    # every key function offered, the weak injected one included: the exact check holds
    layout = CacheLayout(backends)
    bs = max(g.block_size for g in layout.groups)
    head = max(256, bs)
    tail = list(range(7, 7 + 700 + 2 * bs))
    first = thue_morse(a, b, head) + tail
    second = thue_morse(b, a, head) + tail
    m = manager(layout, len(first), key_algorithm=algorithm)
    serve(m, "first", first)
    assert hit(m, first) > 0  # the cache works: the same prompt hits
    assert hit(m, second) == 0  # different at every one of the first `head` positions
    assert m.prefix_stats.collisions == (algorithm is ignores_tokens)


@pytest.mark.parametrize(
    ("stored", "asked"),
    [
        (ExtraKeys(cache_salt="x"), ExtraKeys(adapter="x")),
        (ExtraKeys(cache_salt="x"), ExtraKeys(custom={"cache_salt": "x"})),
        (ExtraKeys(custom={"n": 1}), ExtraKeys(custom={"n": "1"})),
        (ExtraKeys(custom={"n": 1}), ExtraKeys(custom={"n": True})),
        (ExtraKeys(custom={"n": b"1"}), ExtraKeys(custom={"n": "1"})),
        (ExtraKeys(cache_salt="a", adapter="b"), ExtraKeys(cache_salt="b", adapter="a")),
        (None, ExtraKeys(cache_salt="tenant")),
    ],
)
def test_extra_keys_that_print_alike_never_share(stored, asked):
    m = manager(CacheLayout({0: GQABackend(2, 8, 16)}), 200)
    tokens = list(range(100, 300))
    serve(m, "a", tokens, stored)
    assert hit(m, tokens, stored) == 192
    assert hit(m, tokens, asked) == 0


D1, D2 = b"\x01" * 32, b"\x02" * 32


@pytest.mark.parametrize(
    ("stored", "asked", "expected"),
    [
        ([(16, 32, D1)], [(16, 32, D1)], 192),  # the same image: a full hit
        ([(16, 32, D1)], [(16, 32, D2)], 16),  # other content in block 1: blocks 0 only
        ([(15, 16, D1)], [(15, 16, D2)], 0),  # an item that ends on a block edge
        ([(16, 17, D1)], [(16, 17, D2)], 16),  # one that starts on it
        ([(0, 200, D1)], [(0, 200, D2)], 0),  # one spanning every block
        ([(10, 40, D1), (30, 50, D2)], [(10, 40, D1)], 16),  # overlapping items: one left out
        ([(10, 20, D1), (10, 20, D1)], [(10, 20, D1)], 0),  # twice does not cancel to once
        ([(40, 48, D1)], [], 32),  # the item's absence counts too
    ],
)
def test_multimodal_keys_are_hashed_by_position(stored, asked, expected):
    m = manager(CacheLayout({0: GQABackend(2, 8, 16)}), 200)
    tokens = [9] * 200  # placeholder ids: only the digests differ
    serve(m, "a", tokens, mm=[MultimodalKey(*k) for k in stored])
    assert hit(m, tokens, mm=[MultimodalKey(*k) for k in asked]) == expected


@pytest.mark.parametrize("backends", [MODELS[0], MODELS[-1]])
def test_a_forced_key_collision_is_a_counted_miss(backends):
    layout = CacheLayout(backends)
    bs = max(g.block_size for g in layout.groups)
    first = list(range(1, 3 * bs + 2))
    second = list(range(1_000, 1_000 + 3 * bs + 1))  # other tokens, the same length
    m = manager(layout, len(first), key_algorithm=ignores_tokens)
    serve(m, "first", first)
    assert hit(m, first) > 0
    # every key of `second` names one of `first`'s cached blocks, yet nothing is served
    assert hit(m, second) == 0
    assert m.prefix_stats.collisions == 1
    # and a shared prefix still hits exactly as far as the tokens agree
    third = first[: 2 * bs] + second[2 * bs :]
    assert hit(m, third) == (2 * bs // m.boundary) * m.boundary
    assert m.prefix_stats.collisions == 2


def test_a_tuple_of_extra_keys_is_refused_with_what_to_pass():
    with pytest.raises(TypeError, match=r"ExtraKeys\(cache_salt="):
        PrefixQuery([1, 2, 3], ("tenant",))
    with pytest.raises(TypeError, match="mm_keys must be a sequence of MultimodalKey"):
        PrefixQuery([1, 2, 3], None, MultimodalKey(0, 1, D1))
    with pytest.raises(TypeError, match=r"mm_keys\[0\] must be a MultimodalKey"):
        PrefixQuery([1, 2, 3], None, ((0, 1, 7),))


def test_memory_of_the_exact_check_is_bounded_by_what_is_cached():
    m = manager(CacheLayout({0: GQABackend(2, 8, 16)}), 2048)
    tokens = np.arange(2048).tolist()
    serve(m, "a", tokens)
    store = m._prefix.records  # the records behind 128 cached blocks
    assert store.num_records == 2048 // 16
    assert 0 < store.nbytes / 2048 < 40  # bytes per cached token (docs/prefix_keys.md)
    m.reset_prefix_cache()
    assert store.num_records == 0
