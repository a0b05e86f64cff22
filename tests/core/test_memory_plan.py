"""plan_memory: window groups get n windows plus one batch-wide step allowance, per-request
groups their slots, full groups the rest; defaults, warnings and refusals with numbers."""

import os

import pytest

from kvforge import CacheController, DeepseekV4Backend, GQABackend, plan_memory
from kvforge.attn_backends import DeclaredBackend
from kvforge.core.layout import CacheLayout
from kvforge.core.memory_plan import (
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    DEFAULT_MAX_NUM_SEQS,
    MAX_ADDRESSABLE_BYTES,
    MAX_BLOCKS_PER_GROUP,
    cache_bytes_per_sequence,
    check_allocatable,
    device_memory_capacity,
    plan_from_blocks,
)
from kvforge.models import from_hf_config
from kvforge.specs import CacheGroup, CacheRole, GroupKind

GiB = 1 << 30


def cdiv(a, b):
    return -(-a // b)


def tiny_v4():
    kinds = {r: DeepseekV4Backend(r) for r in (0, 4, 128)}
    return {layer: kinds[r] for layer, r in enumerate([0, 0, 4, 128, 4, 128, 0])}


# tiny_v4 device bytes per block: every (layer, role) block is padded to a multiple of 576 B
# (FlashMLA pages, the V4 default block_alignment):
#   swa_kv 64 x 584 = 37,376 -> 65 x 576 = 37,440; compressed_kv (r=4) the same 37,440;
#   indexer 64 x 132 = 8,448 -> 15 x 576 = 8,640; compressed_kv (r=128) 2 x 584 = 1,168
#   -> 3 x 576 = 1,728; compressor_state (r=4) 4 x 2048 x 4 = 32,768 -> 57 x 576 = 32,832;
#   indexer_compressor_state 4 x 512 x 4 = 8,192 -> 15 x 576 = 8,640; compressor_state
#   (r=128) 8 x 1024 x 4 = 32,768 -> 32,832.
# swa 7 layers; compressed 2 c4 layers (kv + indexer) + 2 c128 layers; c4_state 2 layers;
# c128_state 2 layers.
TINY = {"swa": 262_080, "compressed": 95_616, "c4_state": 82_944, "c128_state": 65_664}
# host pages carry no padding: swa 7 x 64 x 584; compressed 2 x (64 x 584 + 64 x 132)
# + 2 x (2 x 584); c4_state 2 x 4 x (2048 + 512) x 4; c128_state 2 x 8 x 1024 x 4
TINY_HOST = {"swa": 261_632, "compressed": 93_984, "c4_state": 81_920, "c128_state": 65_536}


def test_tiny_v4_bytes_per_block():
    layout = CacheLayout(tiny_v4())
    assert {g.name: layout.bytes_per_block(g.name) for g in layout.groups} == TINY
    assert TINY["swa"] == 7 * 65 * 576
    assert TINY["compressed"] == 2 * (65 * 576 + 15 * 576) + 2 * 3 * 576
    assert TINY["c4_state"] == 2 * (57 * 576 + 15 * 576)
    assert TINY["c128_state"] == 2 * 57 * 576
    # the padding is the smallest multiple of 576 over the meaningful bytes
    assert 64 * 584 <= 65 * 576 < 64 * 584 + 576
    assert 64 * 132 <= 15 * 576 < 64 * 132 + 576
    assert 2 * 584 <= 3 * 576 < 2 * 584 + 576
    assert 4 * 2048 * 4 <= 57 * 576 < 4 * 2048 * 4 + 576
    assert 4 * 512 * 4 <= 15 * 576 < 4 * 512 * 4 + 576
    assert {g.name: layout.host_page_bytes(g.name) for g in layout.groups} == TINY_HOST
    assert TINY_HOST["swa"] == 7 * 64 * 584
    assert TINY_HOST["compressed"] == 2 * (64 * 584 + 64 * 132) + 2 * 2 * 584
    assert TINY_HOST["c4_state"] == 2 * 4 * (2048 + 512) * 4
    assert TINY_HOST["c128_state"] == 2 * 8 * 1024 * 4


def test_windows_hold_n_windows_plus_one_step_allowance():
    budget = 64 << 20
    plan = plan_memory(
        tiny_v4(), budget, max_num_seqs=4, max_model_len=4096, max_num_batched_tokens=256
    )
    # window blocks: 4 sequences x blocks a window straddles + cdiv(256, B) + 4, + null
    #   swa: window 128 in 64-token blocks -> (128 + 62) // 64 + 1 = 3; allowance 4 + 4 = 8
    #   c4_state: window 8 in 4-token blocks -> 3; allowance 64 + 4 = 68
    #   c128_state: window 128 in 8-token blocks -> 17; allowance 32 + 4 = 36
    windows = {"swa": 4 * 3 + 8 + 1, "c4_state": 4 * 3 + 68 + 1, "c128_state": 4 * 17 + 36 + 1}
    assert windows == {"swa": 21, "c4_state": 81, "c128_state": 105}
    # 67,108,864 - (21 x 262,080 + 81 x 82,944 + 105 x 65,664)
    #   = 67,108,864 - (5,503,680 + 6,718,464 + 6,894,720) = 67,108,864 - 19,116,864
    rest = budget - sum(n * TINY[g] for g, n in windows.items())
    assert rest == 47_992_000
    compressed = rest // TINY["compressed"]  # 47,992,000 // 95,616 = 501 (x 95,616 = 47,903,616)
    assert compressed == 501
    assert plan.num_blocks == windows | {"compressed": compressed}
    assert plan.max_tokens == (501 - 1) * 256 == 128_000
    # 19,116,864 + 47,903,616
    assert plan.total_bytes == budget - rest + 501 * TINY["compressed"] == 67_020_480
    assert plan.max_concurrency == 4  # window groups hold 4; compressed 500 // 16 = 31
    groups = {g.group: g for g in plan.groups}
    assert {g: p.step_blocks for g, p in groups.items()} == {
        "swa": 8,
        "compressed": 0,
        "c4_state": 68,
        "c128_state": 36,
    }
    assert {g: p.blocks_per_sequence for g, p in groups.items()} == {
        "swa": 3,
        "compressed": 16,
        "c4_state": 3,
        "c128_state": 17,
    }
    assert {g: p.max_sequences for g, p in groups.items()} == {
        "swa": 4,
        "compressed": 31,
        "c4_state": 4,
        "c128_state": 4,
    }
    assert plan.warnings == ()
    assert plan.defaulted == ()
    assert (plan.max_num_seqs, plan.max_model_len, plan.max_num_batched_tokens) == (4, 4096, 256)


def test_describe_prints_the_plan_without_recomputing_it():
    plan = plan_memory(
        tiny_v4(), 64 << 20, max_num_seqs=4, max_model_len=4096, max_num_batched_tokens=256
    )
    assert plan.describe() == [
        # the figures of test_windows_hold_n_windows_plus_one_step_allowance
        "Device memory plan: 67,020,480 B (0.06 GiB) of a 67,108,864 B (0.06 GiB) budget",
        "Planned for max_num_seqs=4, max_model_len=4,096, max_num_batched_tokens=256",
        "  swa (sliding_window, window 128, 64-token blocks): 21 blocks x 262,080 B = "
        "5,503,680 B; 4 sequences of max_model_len, 8 blocks for one step's tokens",
        "  compressed (full, 256-token blocks): 501 blocks x 95,616 B = 47,903,616 B; "
        "31 sequences of max_model_len, 128,000 tokens of history",
        "  c4_state (state, window 8, 4-token blocks): 81 blocks x 82,944 B = 6,718,464 B; "
        "4 sequences of max_model_len, 68 blocks for one step's tokens",
        "  c128_state (state, window 128, 8-token blocks): 105 blocks x 65,664 B = "
        "6,894,720 B; 4 sequences of max_model_len, 36 blocks for one step's tokens",
        "Full-history capacity: 128,000 tokens",
        "Holds 4 sequences of 4,096 tokens at once",
    ]


def test_engine_defaults_are_assumed_and_listed():
    plan = plan_memory(tiny_v4(), 1 * GiB, max_model_len=4096)
    assert plan.defaulted == ("max_num_seqs", "max_num_batched_tokens")
    assert plan.max_num_seqs == DEFAULT_MAX_NUM_SEQS == 256
    assert plan.max_num_batched_tokens == DEFAULT_MAX_NUM_BATCHED_TOKENS == 8192
    # the step allowance of swa: cdiv(8192, 64) + 256
    assert plan.group("swa").step_blocks == 128 + 256
    assert (
        "Planned for max_num_seqs=256 (engine default), max_model_len=4,096, "
        "max_num_batched_tokens=8,192 (engine default)" in plan.describe()
    )


def test_max_model_len_from_the_model():
    layout = CacheLayout(tiny_v4(), max_model_len=4096)
    plan = plan_memory(layout, 1 * GiB)
    assert plan.defaulted == ("max_model_len", "max_num_seqs", "max_num_batched_tokens")
    assert plan.max_model_len == 4096
    given = plan_memory(tiny_v4(), 1 * GiB, max_model_len=4096)
    assert plan.groups == given.groups and plan.max_concurrency == given.max_concurrency
    assert "max_model_len=4,096 (from the model)" in plan.describe()[1]


def test_window_groups_need_a_max_model_len():
    with pytest.raises(
        ValueError,
        match=r"max_model_len is needed to size the window groups \['swa', 'c4_state', "
        r"'c128_state'\]: give max_model_len",
    ):
        plan_memory(tiny_v4(), 1 * GiB, max_num_seqs=4)


def test_all_full_without_length_shares_the_budget_as_before():
    backends = {i: GQABackend(8, 128, 16) for i in range(2)}
    per_block = 2 * 2 * 16 * 8 * 128 * 2  # layers * (k, v) * tokens * heads * dim * bf16
    plan = plan_memory(backends, 10 * per_block + 100)
    assert plan.num_blocks == {"kv": 10}
    assert plan.max_tokens == 9 * 16
    assert (plan.max_num_seqs, plan.max_model_len, plan.max_concurrency) == (None, None, None)
    assert plan.defaulted == () and plan.warnings == ()


def test_all_full_with_length_reports_concurrency_beyond_max_num_seqs():
    backends = {i: GQABackend(8, 128, 16) for i in range(2)}
    per_block = 131_072
    plan = plan_memory(backends, 1001 * per_block, max_num_seqs=2, max_model_len=1024)
    assert plan.num_blocks == {"kv": 1001}
    # 1000 usable blocks / 64 blocks per 1,024-token sequence: not capped by max_num_seqs
    assert plan.max_concurrency == 1000 // 64 == 15
    assert plan.warnings == ()
    short = plan_memory(backends, 1001 * per_block, max_num_seqs=16, max_model_len=1024)
    assert short.max_concurrency == 15
    assert short.warnings == (
        "the plan holds 15 sequences of max_model_len=1,024 tokens at once, fewer than "
        "max_num_seqs=16: groups ['kv'] limit it, and one such sequence needs 8,388,608 bytes "
        "of cache; raise the budget or lower max_num_seqs or max_model_len",
    )
    assert short.describe()[-1] == "Warning: " + short.warnings[0]


def gemma2_like():
    # 42 layers alternating sliding window 4096 (even) and full attention (odd), 8 kv heads of
    # 256, bf16, 16-token blocks: 21 layers x 2 x 16 x 8 x 256 x 2 = 2,752,512 B per block
    swa = GQABackend(8, 256, 16, sliding_window=4096)
    full = GQABackend(8, 256, 16)
    return {layer: swa if layer % 2 == 0 else full for layer in range(42)}


@pytest.mark.parametrize(
    ("seqs", "n", "windows", "history"), [(16, 14, 4_127, 3_674), (256, 13, 4_110, 3_691)]
)
def test_gemma2_on_20gib_holds_what_fits_and_says_so(seqs, n, windows, history):
    per_block = 21 * 2 * 16 * 8 * 256 * 2
    layout = CacheLayout(gemma2_like())
    assert layout.bytes_per_block("swa") == layout.bytes_per_block("kv") == per_block == 2_752_512
    budget = 20 * GiB
    assert budget // per_block == 7_801  # blocks the budget buys, both groups together
    plan = plan_memory(layout, budget, max_num_seqs=seqs, max_model_len=8192)
    # n sequences: swa holds n windows of (4096 + 14) // 16 + 1 = 257 blocks plus the step
    # allowance cdiv(8192, 16) + seqs; kv holds n sequences as long as the window, 256 blocks
    # each (at least one of 8,192 tokens): (257 n + 512 + seqs + 1) + (256 n + 1) <= 7,801
    assert 513 * n + 514 + seqs <= 7_801 < 513 * (n + 1) + 514 + seqs
    assert windows == 257 * n + 512 + seqs + 1
    assert history == 7_801 - windows
    assert plan.num_blocks == {"swa": windows, "kv": history}
    assert plan.max_tokens == (history - 1) * 16
    # 8,192-token sequences: kv holds (history - 1) // 512 = 7, fewer than the windows
    assert plan.max_concurrency == 7 == (history - 1) // 512
    assert plan.group("swa").max_sequences == n
    assert plan.warnings == (
        f"the plan holds 7 sequences of max_model_len=8,192 tokens at once, fewer than "
        f"max_num_seqs={seqs}: groups ['kv'] limit it, and one such sequence needs "
        f"{769 * per_block:,} bytes of cache; raise the budget or lower max_num_seqs or "
        "max_model_len",
    )


def test_windows_are_balanced_at_the_window_length_not_at_max_model_len():
    # At 4,096 tokens (the window) the plan runs n = 13 sequences in both groups; at 8,192
    # the full group holds 7. Sizing swa for the 9 sequences that fit at 8,192 tokens instead
    # would cap every sequence longer than the window at 9.
    plan = plan_memory(gemma2_like(), 20 * GiB, max_num_seqs=256, max_model_len=8192)
    kv, swa = plan.group("kv"), plan.group("swa")
    assert (kv.num_blocks - 1) // 256 == 14 >= 13
    assert (swa.num_blocks - 1 - swa.step_blocks) // 257 == 13
    assert swa.step_blocks == 512 + 256


# DeepSeek-V4-Flash: 43 layers: 21 with ratio 4, 20 with ratio 128, 2 without. Device blocks
# padded to 576 B per (layer, role) as in TINY: swa_kv 37,440 = 65 x 576; compressed_kv (r=4)
# 37,440 + indexer 8,640 = 15 x 576; compressed_kv (r=128) 1,728 = 3 x 576; compressor_state
# 32,832 = 57 x 576; indexer_compressor_state 8,640 = 15 x 576
FLASH = {
    "swa": 43 * 65 * 576,  # 1,609,920
    "compressed": 21 * (65 * 576 + 15 * 576) + 20 * 3 * 576,  # 967,680 + 34,560 = 1,002,240
    "c4_state": 21 * (57 * 576 + 15 * 576),  # 870,912
    "c128_state": 20 * 57 * 576,  # 656,640
}


def flash_windows(seqs, tokens=8192):
    """Blocks of the V4-Flash window groups for seqs sequences (by hand): windows of 3, 3 and
    17 blocks plus the step allowance cdiv(tokens, B) + seqs, plus the null block."""
    return {
        "swa": seqs * 3 + cdiv(tokens, 64) + seqs + 1,
        "c4_state": seqs * 3 + cdiv(tokens, 4) + seqs + 1,
        "c128_state": seqs * 17 + cdiv(tokens, 8) + seqs + 1,
    }


@pytest.mark.parametrize(
    ("seqs", "history", "tokens", "concurrency"),
    # 16 seqs: windows swa 193, c4_state 2,113, c128_state 1,313 blocks = 3,013,119,936 B;
    #   (64,424,509,440 - 3,013,119,936) // 1,002,240 = 61,274; (61,274 - 1) x 256 = 15,685,888
    # 256 seqs: windows swa 1,153, c4_state 3,073, c128_state 5,633 blocks = 8,231,403,456 B;
    #   (64,424,509,440 - 8,231,403,456) // 1,002,240 = 56,067; (56,067 - 1) x 256 = 14,352,896;
    #   concurrency (56,067 - 1) // 256 = 219
    [(16, 61_274, 15_685_888, 16), (256, 56_067, 14_352_896, 219)],
)
def test_deepseek_v4_flash_on_60gib(seqs, history, tokens, concurrency):
    layout = CacheLayout(from_hf_config("deepseek-v4-flash"))
    assert {g.name: layout.bytes_per_block(g.name) for g in layout.groups} == FLASH
    budget = 60 * GiB
    plan = plan_memory(layout, budget, max_num_seqs=seqs, max_model_len=65536)
    # windows for every sequence fit (the window length, 128 tokens, is one compressed block
    # per sequence); the compressed group takes the rest
    windows = flash_windows(seqs)
    window_bytes = sum(c * FLASH[g] for g, c in windows.items())
    assert window_bytes + (max(seqs, 256) + 1) * FLASH["compressed"] <= budget
    assert history == (budget - window_bytes) // FLASH["compressed"]
    assert plan.num_blocks == windows | {"compressed": history}
    assert plan.max_tokens == (history - 1) * 256 == tokens
    # sequences of 65,536 tokens: 256 compressed blocks each
    assert plan.max_concurrency == concurrency == min(seqs, (history - 1) // 256)
    assert (plan.warnings == ()) == (concurrency == seqs)
    assert plan.total_bytes <= budget


def test_deepseek_v4_flash_defaults_to_its_context_length():
    plan = plan_memory(from_hf_config("deepseek-v4-flash"), 60 * GiB)
    assert plan.defaulted == ("max_model_len", "max_num_seqs", "max_num_batched_tokens")
    assert plan.max_model_len == 1_048_576  # the config's max_position_embeddings
    # windows for the 256 default sequences; the history holds 13 sequences of 1M tokens
    windows = flash_windows(256)
    assert {g: c for g, c in plan.num_blocks.items() if g != "compressed"} == windows
    assert plan.max_concurrency == (plan.group("compressed").num_blocks - 1) // 4096 == 13
    assert len(plan.warnings) == 1


def test_two_full_groups_each_hold_whole_sequences_and_run_out_together():
    backends = {
        0: GQABackend(2, 8, 16),
        1: GQABackend(2, 8, 16, sliding_window=64),
        2: GQABackend(2, 8, 32, group="kv32"),
    }
    plan = plan_memory(
        backends, 1 << 20, max_num_seqs=2, max_model_len=1000, max_num_batched_tokens=64
    )
    full = {g.group: g for g in plan.groups if g.kind is GroupKind.FULL}
    assert set(full) == {"kv", "kv32"}
    t = min(full["kv"].max_tokens, full["kv32"].max_tokens)
    assert plan.max_tokens == t
    assert full["kv"].num_blocks == cdiv(t, 16) + 1 and full["kv32"].num_blocks == cdiv(t, 32) + 1
    # swa: 2 windows of (64 + 14) // 16 + 1 = 5 blocks, allowance cdiv(64, 16) + 2 = 6, null
    assert plan.num_blocks["swa"] == 2 * 5 + 6 + 1
    assert full["kv"].max_sequences >= 2 and full["kv32"].max_sequences >= 2


def test_window_reservation_never_exceeds_whole_sequences():
    # max_model_len 1,000 < window 4,096: a sequence never holds more than cdiv(1000, 16) = 63
    # blocks, so 2 sequences never need more than 126, whatever the step allowance says
    backends = {0: GQABackend(2, 8, 16), 1: GQABackend(2, 8, 16, sliding_window=4096)}
    plan = plan_memory(backends, 1 << 20, max_num_seqs=2, max_model_len=1000)
    assert plan.num_blocks["swa"] == 2 * 63 + 1
    assert plan.group("swa").step_blocks == 0
    assert plan.group("swa").max_sequences == 2


class Hybrid(DeclaredBackend):
    """Full attention, chunked local attention (chunk 64) and a two-slot recurrent state."""

    def __init__(self) -> None:
        self.declare(
            [
                CacheGroup(name="kv", block_size=16),
                CacheGroup(name="chunk", block_size=16, kind="chunked", window=64),
                CacheGroup(name="ssm", block_size=1, kind="per_request", slots_per_request=2),
            ],
            [
                CacheRole(name="key", group="kv", entry_shape=(2, 64), dtype="bfloat16"),
                CacheRole(name="ckey", group="chunk", entry_shape=(2, 64), dtype="bfloat16"),
                CacheRole(name="state", group="ssm", entry_shape=(3, 1024), dtype="bfloat16"),
            ],
        )


def test_chunked_and_per_request_groups():
    plan = plan_memory(
        {0: Hybrid()}, 1 << 20, max_num_seqs=4, max_model_len=1024, max_num_batched_tokens=128
    )
    # per block: kv and chunk 16 x 2 x 64 x 2 = 4,096 B; ssm one slot 3 x 1024 x 2 = 6,144 B
    # ssm: 4 requests x 2 slots + null = 9 -> 55,296 B whatever the length
    # chunk: one chunk of 64 in 16-token blocks = 4 blocks per sequence, allowance 8 + 4
    # 4 sequences: 55,296 + ((4 x 4 + 12 + 1) + (64 + 1)) x 4,096 fits in 1 MiB; kv the rest
    assert 55_296 + (29 + 65) * 4096 <= 1 << 20
    chunk = 4 * 4 + 12 + 1
    kv = ((1 << 20) - 55_296 - chunk * 4096) // 4096
    assert kv == 213
    assert plan.num_blocks == {"kv": kv, "chunk": chunk, "ssm": 9}
    groups = {g.group: g for g in plan.groups}
    assert groups["ssm"].slots_per_request == 2 and groups["ssm"].max_sequences == 4
    assert groups["chunk"].max_sequences == 4 and groups["chunk"].step_blocks == 12
    assert groups["kv"].max_sequences == 212 // 64 == 3
    assert plan.max_concurrency == 3
    assert plan.warnings[0].startswith(
        "the plan holds 3 sequences of max_model_len=1,024 tokens at once, fewer than "
        "max_num_seqs=4: groups ['kv'] limit it"
    )


def test_per_request_groups_without_a_length():
    class FullAndState(DeclaredBackend):
        def __init__(self) -> None:
            self.declare(
                [
                    CacheGroup(name="kv", block_size=16),
                    CacheGroup(name="ssm", block_size=1, kind="per_request"),
                ],
                [
                    CacheRole(name="key", group="kv", entry_shape=(64,), dtype="uint8"),
                    CacheRole(name="state", group="ssm", entry_shape=(1000,), dtype="uint8"),
                ],
            )

    plan = plan_memory({0: FullAndState()}, 1 << 20, max_num_seqs=8)
    # ssm: 8 slots + null = 9 x 1,000 B; kv takes the rest in 1,024 B blocks
    assert plan.num_blocks == {"kv": ((1 << 20) - 9_000) // 1024, "ssm": 9}
    assert plan.max_concurrency is None


def test_every_layer_slides_gives_the_rest_to_the_window_group():
    layout = CacheLayout(from_hf_config("mistral-7b-v0.1"))
    per_block = 32 * 2 * 16 * 8 * 128 * 2  # 2 MiB
    plan = plan_memory(layout, 20 * GiB, max_model_len=32768)
    # 257 blocks per 4,096-token window, allowance 512 + 256: n = (10,240 - 769) // 257 = 36
    # windows first; the 459,276,288 B left (219 blocks) go to the window group too, so no
    # budget is left: cached tails and more windows use it
    floor = 36 * 257 + 768 + 1
    spare = 20 * GiB - floor * per_block
    assert spare == 459_276_288 == 219 * per_block
    assert plan.num_blocks == {"swa": floor + 219} == {"swa": 20 * GiB // per_block}
    assert plan.total_bytes == 20 * GiB
    assert plan.max_tokens is None
    assert plan.max_concurrency == 36
    assert not any("unallocated" in line for line in plan.describe())


def test_host_plan_sizes_pages_for_whole_swapped_sequences():
    layout = CacheLayout(from_hf_config("mistral-7b-v0.1"))
    plan = plan_memory(layout, 20 * GiB, max_model_len=32768, host=True)
    per_page = 2 * 1024 * 1024
    n = (20 * GiB - per_page) // (257 * per_page)
    assert n == 39
    assert plan.num_blocks == {"swa": 39 * 257 + 1}
    assert plan.host and plan.max_concurrency == 39
    assert plan.max_num_batched_tokens is None and plan.warnings == ()
    assert plan.defaulted == ("max_num_seqs",)  # 256 bounds the swapped sequences planned


def test_host_plan_full_groups_take_the_rest():
    plan = plan_memory(tiny_v4(), 64 << 20, max_model_len=4096, host=True)
    # n swapped sequences: windows of 3, 3 and 17 pages each, and compressed pages for n
    # sequences as long as the longest window (one 256-token page each), at least one of
    # 4,096 tokens (16 pages); host pages have no step allowance. For n >= 16:
    # nulls + n x (3 swa + 3 c4 + 17 c128 + 1 compressed) <= 64 MiB -> n = 29, in host page
    # bytes (no device padding)
    host = TINY_HOST
    per_seq = 3 * host["swa"] + 3 * host["c4_state"] + 17 * host["c128_state"] + host["compressed"]
    n = ((64 << 20) - sum(host.values())) // per_seq
    assert n == 29
    windows = {"swa": 3 * n + 1, "c4_state": 3 * n + 1, "c128_state": 17 * n + 1}
    rest = (64 << 20) - sum(c * host[g] for g, c in windows.items())
    assert plan.num_blocks == windows | {"compressed": rest // host["compressed"]}
    assert {g.group: g.bytes_per_block for g in plan.groups} == TINY_HOST
    assert plan.num_blocks["compressed"] == 47
    assert plan.max_concurrency == 46 // 16 == 2  # history for two 4,096-token sequences
    assert plan.warnings == ()  # host plans are not bound by max_num_seqs


def test_host_plan_without_length_warns():
    plan = plan_memory(tiny_v4(), 64 << 20, host=True)
    assert plan.warnings == (
        "max_model_len is unknown, so host pages of the window groups ['swa', 'c4_state', "
        "'c128_state'] are sized like full history (the same token capacity), far more than "
        "swapped requests' windows need; give max_model_len to size them for whole sequences",
    )


@pytest.mark.parametrize(
    ("args", "kwargs", "message"),
    [
        ((0,), {}, "memory_budget must be a positive int, got 0"),
        (("1GiB",), {}, "memory_budget must be a positive int, got '1GiB'"),
        ((True,), {}, "memory_budget must be a positive int, got True"),
        ((2.0**30,), {}, "memory_budget must be a positive int, got 1073741824.0"),
        (
            (1 << 63,),
            {},
            r"memory_budget=9,223,372,036,854,775,808 bytes is more than any device can address "
            r"\(9,223,372,036,854,775,807 bytes, 2\*\*63 - 1\)",
        ),
        ((10**40,), {}, "is more than any device can address"),
        ((GiB,), {"max_num_seqs": 0}, "max_num_seqs must be a positive int, got 0"),
        ((GiB,), {"max_model_len": -1}, "max_model_len must be a positive int, got -1"),
        (
            (GiB,),
            {"max_model_len": 4096, "max_num_batched_tokens": 2.5},
            "max_num_batched_tokens must be a positive int, got 2.5",
        ),
        ((GiB,), {"host": "yes"}, "host must be a bool, got 'yes'"),
        (
            (GiB,),
            {"host": True, "max_num_batched_tokens": 256},
            "max_num_batched_tokens=256 does not apply to a host plan",
        ),
        (
            # no sequence yet: each window group's step allowance min(cdiv(8192, B) + 4,
            # 4 x cdiv(4096, B)) + null, the compressed group's null block:
            #   swa (128 + 4 + 1) x 262,080 = 34,856,640; compressed 1 x 95,616;
            #   c4_state (2048 + 4 + 1) x 82,944 = 170,284,032;
            #   c128_state (1024 + 4 + 1) x 65,664 = 67,568,256; sum 272,804,544
            (64 << 20,),
            {"max_num_seqs": 4, "max_model_len": 4096},
            r"memory_budget=67,108,864 bytes is too small for the reservations that do not "
            r"depend on sequence length: 272,804,544 bytes for max_num_seqs=4, "
            r"max_num_batched_tokens=8,192 \(engine default\) \(swa: 34,856,640 B, "
            r"compressed: 95,616 B, c4_state: 170,284,032 B, c128_state: 67,568,256 B\)",
        ),
        (
            # test_one_sequence_cost_in_the_refusal_is_exact derives 404,401,536
            (20 << 20,),
            {"max_num_seqs": 4, "max_model_len": 1 << 20, "max_num_batched_tokens": 256},
            r"memory_budget=20,971,520 bytes is too small for one sequence of "
            r"max_model_len=1,048,576 tokens: the groups' reservations need 404,401,536 bytes",
        ),
        (
            (64 << 20,),
            {"max_model_len": 1 << 20, "host": True},
            r"memory_budget=67,108,864 bytes is too small for one sequence of "
            r"max_model_len=1,048,576 tokens: the host pages need",
        ),
    ],
)
def test_plan_refusals_name_the_value(args, kwargs, message):
    layout = CacheLayout(tiny_v4())
    before = plan_memory(layout, 1 * GiB, max_model_len=4096)
    with pytest.raises(ValueError, match=message):
        plan_memory(layout, *args, **kwargs)
    assert layout.max_model_len is None
    assert plan_memory(layout, 1 * GiB, max_model_len=4096) == before


def test_one_sequence_cost_in_the_refusal_is_exact():
    # 1,048,576 tokens, 4 sequences' allowance of 256 tokens: n = 1 costs
    blocks = {
        "swa": 3 + 4 + 4 + 1,
        "compressed": (1 << 20) // 256 + 1,
        "c4_state": 3 + 64 + 4 + 1,
        "c128_state": 17 + 32 + 4 + 1,
    }
    # swa 12 x 262,080 = 3,144,960; compressed 4,097 x 95,616 = 391,738,752;
    # c4_state 72 x 82,944 = 5,971,968; c128_state 54 x 65,664 = 3,545,856
    assert sum(c * TINY[g] for g, c in blocks.items()) == 404_401_536


@pytest.mark.parametrize(
    ("blocks", "message"),
    [
        (
            {"kv": 10**40},
            r"num_blocks\['kv'\]=10,000,000,000,000,000,000,000,000,000,000,000,000,000 is more "
            r"blocks than int32 block ids can number \(at most 2,147,483,647\)",
        ),
        ({"kv": 1 << 31}, r"num_blocks\['kv'\]=2,147,483,648 is more blocks than int32"),
        ({"kv": 1}, r"num_blocks\['kv'\] must be an int >= 2 .* got 1"),
        ({"kv": True}, r"num_blocks\['kv'\] must be an int >= 2 .* got True"),
        ({"kv": 4.0}, r"num_blocks\['kv'\] must be an int >= 2 .* got 4.0"),
        ({"kv": 4, "swa": 4}, r"unknown \['swa'\], missing \[\]"),
        ({}, r"unknown \[\], missing \['kv'\]"),
    ],
)
def test_plan_from_blocks_refusals(blocks, message):
    layout = CacheLayout({0: GQABackend(2, 8, 16)})
    with pytest.raises(ValueError, match=message):
        plan_from_blocks(layout, blocks)


def test_plan_from_blocks_beyond_64_bit_bytes():
    class Huge(DeclaredBackend):
        def __init__(self) -> None:
            self.declare(
                [CacheGroup(name="g", block_size=1)],
                [CacheRole(name="x", group="g", entry_shape=(1 << 17, 1 << 16), dtype="uint8")],
            )

    layout = CacheLayout({0: Huge()})
    assert layout.bytes_per_block("g") == 1 << 33
    with pytest.raises(
        ValueError,
        match=r"num_blocks\['g'\]=1,073,741,824 blocks of 8,589,934,592 B brings the plan to "
        r"9,223,372,036,854,775,808 bytes, more than any device can address",
    ):
        plan_from_blocks(layout, {"g": 1 << 30})


def test_plan_from_blocks_for_another_machine_is_legal():
    layout = CacheLayout({0: GQABackend(2, 8, 16)})  # 1,024 B per block
    blocks = MAX_BLOCKS_PER_GROUP  # 2 TiB: more than this machine has
    plan = plan_from_blocks(layout, {"kv": blocks})
    assert plan.total_bytes == blocks * 1024
    assert plan.max_tokens == (blocks - 1) * 16


def test_budget_beyond_int32_block_ids_stays_unallocated_and_says_so():
    plan = plan_memory({0: GQABackend(2, 8, 16)}, 1 << 50)  # 1 PiB in 1,024 B blocks
    assert plan.num_blocks == {"kv": MAX_BLOCKS_PER_GROUP}
    spare = (1 << 50) - MAX_BLOCKS_PER_GROUP * 1024
    assert plan.warnings == (
        f"groups ['kv'] reached 2,147,483,647 blocks, the most int32 block ids can number; "
        f"{spare:,} bytes of the budget stay unallocated",
    )


def test_check_allocatable_refuses_what_this_machine_cannot_hold():
    capacity = device_memory_capacity("cpu")
    assert capacity == os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    check_allocatable(1 << 20, "cpu")  # fits: no error
    with pytest.raises(
        ValueError,
        match=rf"cannot allocate {capacity + 1:,} bytes of device caches on cpu: it has "
        rf"{capacity:,} bytes of memory in total",
    ):
        check_allocatable(capacity + 1, "cpu", what="device caches")
    with pytest.raises(ValueError, match="more than any device can address"):
        check_allocatable(10**40, "cpu")
    assert device_memory_capacity("meta") is None
    check_allocatable(MAX_ADDRESSABLE_BYTES, "meta")  # nothing to compare with


@pytest.mark.parametrize("bad", [-1, 1.5, True, "10"])
def test_check_allocatable_bad_sizes(bad):
    with pytest.raises(ValueError, match=f"nbytes must be an int >= 0, got {bad!r}"):
        check_allocatable(bad, "cpu")


def test_cache_bytes_per_sequence_per_kind():
    backends = {0: Hybrid()}
    # kv: 1,000 tokens x 256 B; chunk: tokens 960..999 of the current chunk x 256 B;
    # ssm: 2 slots x 6,144 B
    assert cache_bytes_per_sequence(backends, 1000) == 1000 * 256 + 40 * 256 + 2 * 6144
    assert cache_bytes_per_sequence(backends, 1000, include_state=False) == 1040 * 256
    assert cache_bytes_per_sequence(backends, 0) == 0


def test_controller_allocates_exactly_the_plan():
    backends = {0: GQABackend(2, 8, 16), 1: GQABackend(2, 8, 16, sliding_window=64)}
    ctl = CacheController(backends, share_pools=False)
    plan = ctl.plan_memory(4 << 20, max_num_seqs=4, max_model_len=4096)
    got = ctl.initialize_kv_cache(memory_budget=4 << 20, max_num_seqs=4, max_model_len=4096)
    assert got == plan
    assert ctl.device_bytes == plan.total_bytes
    # shared (the default): kv and swa pair up, so one pool of the plan's bytes with one
    # null block instead of two: the spare one is usable (shared_pool_blocks)
    shared = CacheController(backends)
    assert (
        shared.initialize_kv_cache(memory_budget=4 << 20, max_num_seqs=4, max_model_len=4096)
        == plan
    )
    assert shared.device_bytes == plan.total_bytes
    usable = plan.num_blocks["kv"] + plan.num_blocks["swa"] - 1
    assert shared.scheduler.num_usable_blocks("kv") == usable
    # swa: 4 windows of 5 blocks + cdiv(8192, 16) + 4 + null
    assert plan.num_blocks["swa"] == 4 * 5 + 512 + 4 + 1
