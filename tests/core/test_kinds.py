"""Group kinds are rule objects (kvforge.kinds): the bundled rules' arithmetic, and a new kind
that is one rule object plus this test, run through validation, the planner, the scheduler
side, the worker side and a byte-exact swap round trip."""

from __future__ import annotations

import numpy as np
import pytest

from kvforge import CacheController, CacheGroup, CacheRole
from kvforge.attn_backends import DeclaredBackend
from kvforge.kinds import (
    GroupFamily,
    KindRule,
    held_blocks,
    live_start,
    register_kind,
    registered_kinds,
    rule_of,
    unregister_kind,
)
from kvforge.verify import verify_request, write_request


class BlockWindowRule(KindRule):
    """Test-only kind: a sliding window that keeps whole blocks, so its live range starts on
    a block edge (``W = 64`` over 16-token blocks: token 100 reads from token 32, not 37)."""

    name = "block_window"
    family = GroupFamily.WINDOW
    needs_window = True

    def window_start(self, group, first_read):
        start = np.maximum(0, first_read + 1 - int(group.window))
        return (start // group.block_size) * group.block_size

    def max_live_blocks(self, group, max_model_len):
        window, block = int(group.window), group.block_size
        return min(self.blocks_for(group, max_model_len), -(-window // block) + 1)


@pytest.fixture
def block_window():
    rule = register_kind(BlockWindowRule())
    yield rule
    unregister_kind("block_window")


def test_bundled_rules_worked_arithmetic():
    # sliding window W = 128 over B = 64 at rest after 300 tokens: tokens 172..299, blocks 2..4
    swa = CacheGroup(name="swa", block_size=64, kind="sliding_window", window=128)
    assert (live_start(swa, 300), held_blocks(swa, 300, 300)) == (172, 3)
    # a 512-token first chunk writes every token: all 8 blocks until the next step
    assert held_blocks(swa, 0, 512) == 8
    # chunked W = 8192, B = 16: token 10,000 reads its chunk from 8192
    chunk = CacheGroup(name="c", block_size=16, kind="chunked", window=8192)
    assert chunk.rule.tail_start(chunk, 10_000) == 8192
    assert chunk.max_live_blocks(1 << 20) == 8192 // 16
    full = CacheGroup(name="kv", block_size=16)
    assert (full.rule.history, full.rule.tail_start(full, 999), full.max_live_blocks(100)) == (
        True,
        0,
        7,
    )
    state = CacheGroup(name="s", block_size=4, kind="state", window=8)
    assert state.rule.recomputed_for_prefix and not swa.rule.recomputed_for_prefix
    lin = CacheGroup(name="lin", block_size=1, kind="per_request", slots_per_request=2)
    assert (lin.blocks_for(0), lin.blocks_for(5), lin.rule.step_allowance(lin, 4, 100)) == (0, 2, 0)
    # the step allowance of a window group: cdiv(8192, 64) + 16 requests
    assert swa.rule.step_allowance(swa, 16, 8192) == 128 + 16
    assert registered_kinds()[:5] == ("full", "sliding_window", "state", "chunked", "per_request")


def test_a_new_kind_is_one_rule_object(block_window):
    g = CacheGroup(name="bw", block_size=16, kind="block_window", window=64)
    assert g.kind == "block_window" and g.rule is block_window and g.windowed
    assert g.live_token_range(101).start == 32  # 101 - 64 = 37, down to the block edge
    assert g.max_live_blocks(4096) == 5

    class Backend(DeclaredBackend):
        def __init__(self):
            super().__init__()
            self.declare(
                [g],
                [
                    CacheRole(name="key", group="bw", entry_shape=(2, 8), dtype="bfloat16"),
                    CacheRole(name="value", group="bw", entry_shape=(2, 8), dtype="bfloat16"),
                ],
            )

    ctl = CacheController({0: Backend(), 1: Backend()})
    plan = ctl.initialize_kv_cache(memory_budget=1 << 20, max_num_seqs=4, max_model_len=512)
    assert plan.num_blocks["bw"] > 4 * 5
    ctl.initialize_host_cache(num_pages=64)
    ctl.allocate("r", 200)  # one step of 200 tokens: every block until the next step
    assert ctl.block_table("r", "bw") == list(range(1, 14))
    ctl.allocate("r", 201)  # the next step reads from token 200 + 1 - 64 = 137 -> block 8
    table = ctl.block_table("r", "bw")
    assert table[:8] == [0] * 8 and all(b > 0 for b in table[8:])
    written = write_request(ctl, "r", seed=3, positions=range(201))
    assert written == 2 * 2 * (201 - 128)  # layers x roles x live tokens (blocks 8..12)
    ctl.swap_out("r")
    for cache in ctl.kv_caches:
        cache.zero_()
    ctl.swap_in("r")
    check = verify_request(ctl, "r", seed=3)
    assert (check.entries, check.mismatched) == (written, 0)
    ctl.free()


@pytest.mark.parametrize(
    ("rule", "exception", "message"),
    [
        (object(), TypeError, "rule must be a KindRule instance, got object"),
        (
            BlockWindowRule.__new__(type("Nameless", (KindRule,), {"family": GroupFamily.WINDOW})),
            ValueError,
            "rule.name must be a non-empty str",
        ),
        (
            type("NoFamily", (KindRule,), {"name": "x", "family": "window"})(),
            ValueError,
            "rule.family must be a GroupFamily, got 'window'",
        ),
        (
            type("Dup", (KindRule,), {"name": "full", "family": GroupFamily.HISTORY})(),
            ValueError,
            "group kind 'full' is already registered",
        ),
    ],
)
def test_bad_registrations_change_nothing(rule, exception, message):
    before = registered_kinds()
    with pytest.raises(exception, match=message):
        register_kind(rule)
    assert registered_kinds() == before


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: unregister_kind("full"), "group kind 'full' is bundled and cannot be removed"),
        (lambda: unregister_kind("nope"), "group kind 'nope' is not registered"),
        (lambda: rule_of("nope"), r"kind must be one of \['full', .*got 'nope'"),
        (lambda: CacheGroup(name="g", block_size=16, kind="nope"), "kind must be one of"),
    ],
)
def test_unknown_kinds_are_refused(call, message):
    before = registered_kinds()
    with pytest.raises(ValueError, match=message):
        call()
    assert registered_kinds() == before


def test_a_registered_kind_is_validated_like_a_bundled_one(block_window):
    with pytest.raises(ValueError, match="window is required for a block_window group"):
        CacheGroup(name="bw", block_size=16, kind="block_window")
    with pytest.raises(ValueError, match="slots_per_request=2 is only for per_request groups"):
        CacheGroup(name="bw", block_size=16, kind="block_window", window=64, slots_per_request=2)
