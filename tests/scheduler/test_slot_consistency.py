"""One step, one answer: the per-request ``slot_mapping`` of a step's positions gives exactly
the slots the step API (``schedule(...).inputs.slot_mappings``) gave for that step.

A step's kernels write every token it schedules, so a 512-token prefill through a 128-token
window writes 512 slots, and the window blocks it writes stay held until the request's next
step. Both APIs must say so, whichever one an engine follows (issue 21).
"""

from __future__ import annotations

import numpy as np
import pytest

from kvforge import CacheController, DeepseekV4Backend, GQABackend

# ------------------------------------------------------------------ models

MODELS = {
    # one full-attention group
    "full": lambda: {0: GQABackend(2, 8, 16)},
    # GQA sliding window of 128 beside full layers (gpt-oss / Gemma-2 style)
    "gqa-swa": lambda: {
        0: GQABackend(2, 8, 16, sliding_window=128),
        1: GQABackend(2, 8, 16),
    },
    # a window that is not a multiple of the block, over blocks of 64
    "gqa-swa-100": lambda: {
        0: GQABackend(2, 8, 64, sliding_window=100),
        1: GQABackend(2, 8, 64),
    },
    # chunked local attention (Llama-4 style), chunks of 128
    "gqa-chunked": lambda: {
        0: GQABackend(2, 8, 16, attention_chunk_size=128),
        1: GQABackend(2, 8, 16),
    },
    # DeepSeek-V4: swa (window 128), compressed (ratios 4 and 128), c4_state, c128_state
    "deepseek-v4": lambda: {
        0: DeepseekV4Backend(0),
        1: DeepseekV4Backend(4),
        2: DeepseekV4Backend(128),
    },
}


def controller(model: str, prefix: bool = False) -> CacheController:
    ctl = CacheController(MODELS[model](), enable_prefix_caching=prefix)
    ctl.initialize_kv_cache(num_blocks=1200)
    return ctl


# ------------------------------------------------------------------ step shapes
# Each step: [(request, new tokens), ...]; every request of a step is scheduled together.

SHAPES = {
    "prefill-512": [[("a", 512)], [("a", 1)], [("a", 1)]],
    "chunked-prefill": [[("a", 100)]] * 5 + [[("a", 12)], [("a", 1)]],
    "decode": [[("a", 300)]] + [[("a", 1)]] * 6,
    "window-sized-chunks": [[("a", 128)], [("a", 128)], [("a", 129)], [("a", 1)]],
    "odd-sizes": [[("a", 77)], [("a", 190)], [("a", 3)], [("a", 255)], [("a", 1)]],
    "batch": [
        [("a", 512), ("b", 130)],
        [("a", 1), ("b", 200), ("c", 64)],
        [("a", 1), ("b", 1), ("c", 400)],
        [("c", 1), ("a", 1)],
    ],
}

CASES = [(m, s) for m in MODELS for s in SHAPES]


def step_slots(ctl: CacheController, step, i: int) -> dict[tuple[str, int], np.ndarray]:
    """The step API's slots and positions of request ``i`` of ``step``."""
    inputs = step.inputs
    mine = inputs.request_index == i
    out = {key: np.asarray(s)[mine] for key, s in inputs.slot_mappings.items()}
    out[("positions", 0)] = inputs.positions[mine]
    return out


def per_request(ctl: CacheController, rid: str, positions: np.ndarray) -> dict:
    out = {}
    for g in ctl.layout.groups:
        for ratio in ctl.layout.compress_ratios(g.name):
            out[(g.name, ratio)] = ctl.slot_mapping(
                rid, g.name, positions, compress_ratio=ratio
            ).numpy()
    out[("positions", 0)] = positions
    return out


def assert_same(a: dict, b: dict, where: str) -> None:
    assert a.keys() == b.keys(), where
    for key in a:
        assert a[key].tolist() == b[key].tolist(), f"{where}: {key}"


def expected_written(ctl: CacheController, slots: dict, positions: np.ndarray, where: str):
    """Every token of a step writes an entry of every ratio-1 role, and a ratio-``r`` role
    exactly at the tokens that complete a compressed entry."""
    for (group, ratio), s in slots.items():
        if group == "positions":
            continue
        complete = positions % ratio == ratio - 1
        assert (s[complete] >= 0).all(), f"{where}: {group}/{ratio} dropped a write"
        assert (s[~complete] == -1).all(), f"{where}: {group}/{ratio}"


@pytest.mark.parametrize(("model", "shape"), CASES)
def test_schedule_and_per_request_slot_mapping_agree(model, shape):
    """The same controller, asked both ways about each step."""
    ctl = controller(model)
    for n, batch in enumerate(SHAPES[shape]):
        ids = [r for r, _ in batch]
        step = ctl.schedule(ids, [k for _, k in batch])
        assert not step.allocation.refused
        for i, rid in enumerate(ids):
            where = f"{model} {shape} step {n} request {rid}"
            want = step_slots(ctl, step, i)
            positions = want[("positions", 0)]
            assert len(positions) == dict(batch)[rid]
            expected_written(ctl, want, positions, where)
            assert_same(per_request(ctl, rid, positions), want, where)
        ctl.end_step(step)
        # ending the step changes no answer: its window blocks stay until the next step
        for i, rid in enumerate(ids):
            want = step_slots(ctl, step, i)
            got = per_request(ctl, rid, want[("positions", 0)])
            assert_same(got, want, f"{model} {shape} step {n} after end_step")


@pytest.mark.parametrize(("model", "shape"), CASES)
def test_allocate_and_schedule_agree(model, shape):
    """``allocate`` one request at a time (the README's per-request path) against
    ``schedule`` of the same single-request steps on a twin controller: same blocks, and the
    per-request slots of each step are the step API's."""
    by_allocate, by_schedule = controller(model), controller(model)
    for n, batch in enumerate(SHAPES[shape]):
        for rid, k in batch:
            where = f"{model} {shape} step {n} request {rid}"
            held = by_allocate.num_tokens(rid) if rid in by_allocate.requests else 0
            by_allocate.allocate(rid, held + k)
            step = by_schedule.schedule([rid], [k])
            by_schedule.end_step(step)
            want = step_slots(by_schedule, step, 0)
            positions = want[("positions", 0)]
            assert positions.tolist() == list(range(held, held + k))
            for g in by_allocate.groups:
                assert by_allocate.block_table(rid, g) == by_schedule.block_table(rid, g), where
            assert_same(per_request(by_allocate, rid, positions), want, where)


# ------------------------------------------------------------------ the case


@pytest.mark.parametrize("model", ["gqa-swa", "deepseek-v4"])
def test_allocate_512_through_a_128_window_gives_512_slots(model):
    ctl = controller(model)
    ctl.allocate("r", 512)
    slots = ctl.slot_mapping("r", "swa", range(512))
    # every token of the 512-token step is written (issue 21: it gave 128)
    assert (slots >= 0).sum() == 512
    assert len(set(slots.tolist())) == 512
    table = ctl.block_table("r", "swa")
    block = ctl.layout.group("swa").block_size
    assert slots.tolist() == [table[p // block] * block + p % block for p in range(512)]
    # the next step releases what slid out: token 512 reads 385..512 only
    ctl.allocate("r", 513)
    slots = ctl.slot_mapping("r", "swa", range(513))
    assert (slots[:385] == -1).all()
    assert (slots[385:] >= 0).all()


def test_positions_outside_the_latest_step_keep_the_resting_window():
    # grown 64 tokens a step to 200: the step 192..199 read back to 65, and between steps
    # only the last 128 tokens (72..199) are live; 0..71 stay -1 whether held or not
    ctl = controller("deepseek-v4")
    for n in (64, 128, 192, 200):
        ctl.allocate("r", n)
    slots = ctl.slot_mapping("r", "swa", range(200)).tolist()
    assert all(s == -1 for s in slots[:72])
    assert all(s >= 0 for s in slots[72:])


def test_truncate_falls_back_to_the_resting_window():
    # a step 0..512 rolled back to 300 tokens: the step's answer no longer applies, the
    # resting window of 300 tokens (172..299) does
    ctl = controller("gqa-swa")
    ctl.allocate("r", 512)
    ctl.truncate("r", 300)
    slots = ctl.slot_mapping("r", "swa", range(300))
    assert (slots[:172] == -1).all() and (slots[172:] >= 0).all()


def test_a_reused_row_does_not_inherit_the_last_step():
    # "a" wrote 512 tokens in row 0 and finished; "b" takes the row over with a decode-sized
    # history of its own: only its own steps count
    ctl = controller("gqa-swa")
    ctl.allocate("a", 512)
    ctl.free_request("a")
    for n in (64, 128, 192, 256, 320, 384, 448, 512):
        ctl.allocate("b", n)
    slots = ctl.slot_mapping("b", "swa", range(512))
    assert (slots[:384] == -1).all() and (slots[384:] >= 0).all()


def test_prefix_hit_step_agrees():
    """A request that starts from a prefix hit: its first step writes the tokens after the
    hit, and both APIs give the same slots for them."""
    from kvforge.core.values import PrefixQuery

    ctl = controller("gqa-swa", prefix=True)
    prompt = list(range(1000, 1512))
    step = ctl.schedule(["a"], [512], [prompt])
    ctl.end_step(step)
    ctl.free_request("a")
    (match,) = ctl.lookup([PrefixQuery([*prompt, 7, 8, 9])])
    assert match.num_tokens > 0
    rest = [*prompt, 7, 8, 9][match.num_tokens :]
    step = ctl.schedule(["b"], [len(rest)], [rest], [match])
    assert not step.allocation.refused
    want = step_slots(ctl, step, 0)
    positions = want[("positions", 0)]
    assert positions[0] == match.num_tokens
    expected_written(ctl, want, positions, "prefix hit")
    assert_same(per_request(ctl, "b", positions), want, "prefix hit")
    ctl.end_step(step)


def test_after_a_swap_only_what_came_back_has_slots():
    # a swap moves the resting window only: the 512-token step's slid-out blocks stay behind
    ctl = controller("gqa-swa")
    ctl.initialize_host_cache(num_pages=200)
    ctl.allocate("r", 512)
    ctl.swap_out("r").wait()
    ctl.swap_in("r").wait()
    slots = ctl.slot_mapping("r", "swa", range(512))
    assert (slots[:384] == -1).all() and (slots[384:] >= 0).all()
    assert (ctl.slot_mapping("r", "kv", range(512)) >= 0).all()
