"""plan_memory with max_num_seqs / max_model_len, and initialize_kv_cache from such a plan."""

import pytest

from kvforge import CacheController, DeepseekV4Backend, GQABackend, plan_memory
from kvforge.cache_controller import CacheLayout


def tiny_v4():
    kinds = {r: DeepseekV4Backend(r) for r in (0, 4, 128)}
    return {layer: kinds[r] for layer, r in enumerate([0, 0, 4, 128, 4, 128, 0])}


def test_windows_get_max_num_seqs_windows_and_full_groups_share_the_rest():
    backends = tiny_v4()
    layout = CacheLayout(backends)
    budget = 64 << 20
    plan = plan_memory(backends, budget, max_num_seqs=4, max_model_len=4096)
    blocks = plan.num_blocks
    # swa: window 128 in 64-token blocks straddles at most 3 blocks; c4_state: window 8 in
    # 4-token blocks -> 3; c128_state: window 128 in 8-token blocks -> 17. Plus the null block.
    assert blocks["swa"] == 4 * 3 + 1
    assert blocks["c4_state"] == 4 * 3 + 1
    assert blocks["c128_state"] == 4 * 17 + 1
    windowed = sum(blocks[g] * layout.bytes_per_block(g) for g in ("swa", "c4_state", "c128_state"))
    rest = budget - windowed
    per_block = layout.bytes_per_block("compressed")
    assert blocks["compressed"] == rest // per_block  # the only full group takes all it can
    assert plan.max_tokens == (blocks["compressed"] - 1) * 256
    assert plan.total_bytes <= budget
    assert plan.max_num_seqs == 4 and plan.max_model_len == 4096


def test_controller_allocates_exactly_the_plan():
    ctl = CacheController(tiny_v4())
    plan = ctl.plan_memory(64 << 20, max_num_seqs=4, max_model_len=4096)
    got = ctl.initialize_kv_cache(memory_budget=64 << 20, max_num_seqs=4, max_model_len=4096)
    assert got == plan
    assert ctl.device_bytes == plan.total_bytes
    for g in plan.groups:
        assert ctl.num_usable_blocks(g.group) == g.num_blocks - 1
    # four sequences of max_model_len fit in the window groups at once
    for i in range(4):
        ctl.allocate(f"r{i}", 300)
        ctl.allocate(f"r{i}", 301)


def test_two_full_groups_run_out_at_the_same_token_count():
    backends = {
        0: GQABackend(2, 8, 16),
        1: GQABackend(2, 8, 16, sliding_window=64),
        2: GQABackend(2, 8, 32, group="kv32"),
    }
    plan = plan_memory(backends, 1 << 20, max_num_seqs=2, max_model_len=1000)
    full = {g.group: g for g in plan.groups if g.kind.value == "full"}
    assert set(full) == {"kv", "kv32"}
    t = plan.max_tokens
    assert full["kv"].num_blocks == -(-t // 16) + 1 and full["kv32"].num_blocks == -(-t // 32) + 1
    assert {g.group: g.num_blocks for g in plan.groups}["swa"] == 2 * 5 + 1  # (64 + 14) // 16 + 1


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_num_seqs": 4}, "max_num_seqs and max_model_len go together"),
        ({"max_num_seqs": 0, "max_model_len": 10}, "max_num_seqs must be a positive int, got 0"),
        (
            {"max_num_seqs": 1000, "max_model_len": 4096},
            r"window and state groups alone need [\d,]+ bytes for max_num_seqs=1000",
        ),
    ],
)
def test_plan_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        plan_memory(tiny_v4(), 64 << 20, **kwargs)


def test_full_groups_too_small_after_windows():
    layout = CacheLayout(tiny_v4())
    windowed = (
        13 * layout.bytes_per_block("swa")
        + 13 * layout.bytes_per_block("c4_state")
        + 69 * layout.bytes_per_block("c128_state")
    )
    with pytest.raises(ValueError, match="too small for the full groups after windows"):
        plan_memory(tiny_v4(), windowed + 10, max_num_seqs=4, max_model_len=4096)
