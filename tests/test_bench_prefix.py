"""The prefix-reuse benchmark (``kvforge.commands.bench_prefix``) on a tiny seeded workload:
record structure, the oracles' ordering, equality with the aligned oracle when nothing is
evicted, determinism, and bad workload parameters. No timing is asserted."""

from __future__ import annotations

import json
from fractions import Fraction

import pytest
from pydantic import ValidationError

from kvforge.commands.bench_prefix import (
    PrefixRecord,
    PrefixWorkload,
    make_conversations,
    run_prefix_bench,
    write_prefix_json,
)

TINY = PrefixWorkload(
    seed=3,
    num_conversations=6,
    concurrency=4,
    max_num_seqs=2,
    system_prompt_len=300,
    user_median=40.0,
    output_median=60.0,
    output_max=200,
    user_max=400,
    chunk_size=256,
    max_num_batched_tokens=512,
    max_model_len=4096,
)
FRACTIONS = (Fraction(1), Fraction(1, 4))
JSON_FIELDS = {
    "model", "memory_bytes", "hit_rate", "oracle_hit_rate", "token_oracle_hit_rate",
    "history_only_hit_rate", "lru_hit_rate", "evictions", "hash_us", "lookup_us",
    "vllm_hash_us", "vllm_lookup_us",
}


@pytest.fixture(scope="module")
def records() -> list[PrefixRecord]:
    models = ("llama-3-8b", "gpt-oss-20b", "deepseek-v4-flash")
    return run_prefix_bench(
        TINY, models, dict.fromkeys(models, FRACTIONS), cost_repeats=3
    )


def test_conversations_are_multi_turn_and_seeded() -> None:
    convs = make_conversations(TINY)
    assert len(convs) == 6
    for c in convs:
        assert 2 <= len(c.prompt_lens) <= 8
        assert c.prompt_lens[0] > TINY.system_prompt_len
        # the next prompt holds the previous prompt and its whole output
        for k in range(1, len(c.prompt_lens)):
            assert c.prompt_lens[k] > c.prompt_lens[k - 1] + c.output_lens[k - 1]
        assert len(c.tokens) == c.prompt_lens[-1] + c.output_lens[-1]
        assert (c.tokens[:300] == convs[0].tokens[:300]).all()  # the shared system prompt
    again = make_conversations(TINY)
    assert [c.prompt_lens for c in again] == [c.prompt_lens for c in convs]
    assert all((a.tokens == b.tokens).all() for a, b in zip(again, convs, strict=True))


def test_record_structure(records: list[PrefixRecord], tmp_path) -> None:
    assert [(r.model, r.fraction) for r in records] == [
        (m, f) for m in ("llama-3-8b", "gpt-oss-20b", "deepseek-v4-flash") for f in ("1", "1/4")
    ]
    path = tmp_path / "prefix.json"
    write_prefix_json(records, path)
    data = json.loads(path.read_text())
    assert len(data) == 6
    for row in data:
        assert set(row) >= JSON_FIELDS
        assert row["vllm_hash_us"] is None and row["vllm_lookup_us"] is None
        assert isinstance(row["memory_bytes"], int) and row["memory_bytes"] > 0
        assert row["hash_us"] > 0 and row["lookup_us"] > 0
    assert data[0]["memory_bytes"] > data[1]["memory_bytes"]


def test_oracles_order_and_no_eviction_equality(records: list[PrefixRecord]) -> None:
    for r in records:
        assert r.token_oracle_tokens >= r.oracle_tokens >= r.hit_tokens
        assert r.preemptions == 0 and r.lru_preemptions == 0
        if r.fraction == "1":
            assert r.evictions == {}
            assert r.hit_tokens == r.oracle_tokens
            assert r.hit_rate == r.oracle_hit_rate
    llama = [r for r in records if r.model == "llama-3-8b"]
    # one full group and no window: the history-only cache loses nothing
    assert llama[0].history_only_hit_rate == llama[0].oracle_hit_rate
    deepseek = [r for r in records if r.model == "deepseek-v4-flash"]
    assert deepseek[0].history_only_hit_rate < deepseek[0].oracle_hit_rate
    # every DeepSeek-V4 hit is a multiple of the 256-token boundary
    assert deepseek[0].hit_tokens % 256 == 0


def test_deterministic_for_a_seed(records: list[PrefixRecord]) -> None:
    again = run_prefix_bench(
        TINY, ("deepseek-v4-flash",), {"deepseek-v4-flash": FRACTIONS}, cost_repeats=0
    )
    before = [r for r in records if r.model == "deepseek-v4-flash"]
    keys = ("memory_bytes", "hit_tokens", "oracle_tokens", "token_oracle_tokens", "lru_tokens")
    assert [[getattr(r, k) for k in keys] for r in again] == [
        [getattr(r, k) for k in keys] for r in before
    ]
    assert [r.evictions for r in again] == [r.evictions for r in before]


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"min_turns": 5, "max_turns": 4}, "max_turns must be >= min_turns (5), got 4"),
        ({"think_min": 9, "think_max": 3}, "think_max must be >= think_min (9), got 3"),
        ({"system_prompt_len": 100, "max_model_len": 101}, "system_prompt_len=100"),
        ({"num_conversations": 0}, "num_conversations"),
        ({"user_median": 0.0}, "user_median"),
        ({"bogus": 1}, "bogus"),
    ],
)
def test_bad_workload(kwargs: dict, fragment: str) -> None:
    with pytest.raises(ValidationError) as info:
        PrefixWorkload(**kwargs)
    assert fragment in str(info.value)
