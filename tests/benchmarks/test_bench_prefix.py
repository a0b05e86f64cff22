"""The prefix-reuse benchmark (``prefix_sim``) on a tiny seeded workload:
record structure, the oracles' ordering, equality with the aligned oracle when nothing is
evicted, determinism, and bad workload parameters. No timing is asserted."""

from __future__ import annotations

import json
from fractions import Fraction

import prefix_sim
import pytest
from prefix_sim import (
    LruModel,
    ManagerModel,
    PrefixRecord,
    PrefixWorkload,
    build_layout,
    make_conversations,
    run_prefix_bench,
    simulate,
    split_pools,
    tail_blocks,
    write_prefix_json,
)
from pydantic import ValidationError

from kvforge.core.memory_plan import shared_pool_blocks

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
    "model",
    "memory_bytes",
    "hit_rate",
    "oracle_hit_rate",
    "token_oracle_hit_rate",
    "history_only_hit_rate",
    "lru_hit_rate",
    "evictions",
    "hash_us",
    "lookup_us",
    "vllm_hash_us",
    "vllm_lookup_us",
}


@pytest.fixture(scope="module")
def records() -> list[PrefixRecord]:
    models = ("llama-3-8b", "gpt-oss-20b", "deepseek-v4-flash")
    return run_prefix_bench(TINY, models, dict.fromkeys(models, FRACTIONS), cost_repeats=3)


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


@pytest.mark.slow
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
            # window/state pools hold only the tails the oracle's hits need: dead tails go,
            # history never does
            assert "history" not in r.evictions
            assert r.hit_tokens == r.oracle_tokens
            assert r.hit_rate == r.oracle_hit_rate
    llama = [r for r in records if r.model == "llama-3-8b"]
    # one full group and no window: the history-only cache loses nothing
    assert llama[0].history_only_hit_rate == llama[0].oracle_hit_rate
    deepseek = [r for r in records if r.model == "deepseek-v4-flash"]
    assert deepseek[0].history_only_hit_rate < deepseek[0].oracle_hit_rate
    # every DeepSeek-V4 hit is a multiple of the 256-token boundary
    assert deepseek[0].hit_tokens % 256 == 0


@pytest.mark.slow
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


def test_record_pools_and_memory(records: list[PrefixRecord]) -> None:
    # the LRU's budget is exactly the bytes of kvforge's pools (null blocks excluded)
    for r in records:
        layout = build_layout(r.model)
        # a shared pool's blocks are paid once, whichever of its groups holds them
        assert r.memory_bytes == sum(
            n * int(layout.bytes_per_block(pool.split("+")[0])) for pool, n in r.pool_blocks.items()
        )
        assert set(r.pool_blocks) == {"+".join(s) for s in layout.pool_sets}
    gpt_oss = [r for r in records if r.model == "gpt-oss-20b"]
    assert gpt_oss and all(set(r.pool_blocks) == {"swa+kv"} for r in gpt_oss)
    llama = [r for r in records if r.model == "llama-3-8b"]
    assert [r.tail_cache_tails for r in llama] == [0, 0]


@pytest.mark.parametrize(
    ("model", "expected"),
    [
        # the worked example of BlockManager.lookup: swa blocks 10, 11; c4_state 190, 191;
        # c128_state 80..95
        ("deepseek-v4-flash", {"swa": 2, "compressed": 0, "c4_state": 2, "c128_state": 16}),
        ("gpt-oss-20b", {"swa": 8, "kv": 0}),  # window 128, block 16, boundary 16
        ("llama-3-8b", {"kv": 0}),
    ],
)
def test_tail_blocks(model: str, expected: dict[str, int]) -> None:
    layout = build_layout(model)
    assert {g.name: tail_blocks(layout, g) for g in layout.groups} == expected


def test_split_pools_gives_windows_floor_and_tails_and_full_the_rest() -> None:
    layout = build_layout("gpt-oss-20b")
    swa, kv = int(layout.bytes_per_block("swa")), int(layout.bytes_per_block("kv"))
    ws = {"swa": 500, "kv": 4000}
    floor = {"swa": 300, "kv": 100}
    memory = 340 * swa + 1234 * kv + kv - 1  # one byte short of another kv block
    # swa: floor + 5 tails of 8 blocks; kv: every whole block of the rest; + the null block
    assert split_pools(layout, ws, floor, 5, memory) == {"swa": 341, "kv": 1235}
    # the tail cache is capped at the working set
    assert split_pools(layout, ws, floor, 100, memory)["swa"] == 501
    # too little memory: the full group keeps its floor
    assert split_pools(layout, ws, floor, 5, 340 * swa) == {"swa": 341, "kv": 101}


def test_floor_blocks_is_the_planners_reserve_for_windows() -> None:
    layout = build_layout("deepseek-v4-flash")
    live_peak = {"swa": 1, "compressed": 77, "c4_state": 2, "c128_state": 3}
    floor = prefix_sim.floor_blocks(layout, TINY, live_peak)
    seqs, batched = TINY.max_num_seqs, TINY.max_num_batched_tokens
    # c4_state: 4-token blocks, window 8: 3 live blocks per request plus the step allowance
    assert floor["c4_state"] == seqs * 3 + (-(-batched // 4) + seqs)
    assert floor["compressed"] == 77  # a full group: what the running requests held


def test_shared_pool_blocks_pools_usable_blocks_of_a_shared_set() -> None:
    assert shared_pool_blocks(build_layout("gpt-oss-20b"), {"swa": 300, "kv": 501}) == {
        "swa": 801,
        "kv": 801,
    }
    per_group = {"swa": 5, "compressed": 6, "c4_state": 7, "c128_state": 8}
    assert shared_pool_blocks(build_layout("deepseek-v4-flash"), per_group) == per_group


@pytest.mark.parametrize(
    ("model", "families"),
    [
        # one full group: the LRU's byte budget is the group's pool
        ("llama-3-8b", {"history"}),
        # gpt-oss's swa and kv pair up byte for byte and share one pool: the LRU over both
        # groups is that pool's policy
        ("gpt-oss-20b", {"history", "window"}),
    ],
)
def test_lru_matches_block_manager_on_one_pool(model: str, families: set[str]) -> None:
    """Where every group draws on one pool, BlockManager does at least what a plain LRU over
    all groups does at the same memory, turn by turn, with no more evictions per family. With
    one group (Llama) they are the same policy exactly. With a window group (gpt-oss) the
    newest copy of a key wins: window blocks a request recomputes take over keys the LRU
    lets go, and later turns hit them (``tests/scheduler/test_newest_copy.py``)."""
    layout = build_layout(model)
    convs = make_conversations(TINY)
    oracle = ManagerModel(
        layout,
        prefix_sim._unbounded_blocks(layout, convs),
        TINY.max_num_seqs,
        TINY.max_model_len,
    )
    simulate(TINY, convs, oracle)
    names = [g.name for g in layout.groups]
    assert layout.pool_sets == (tuple(names),)
    live = sum(oracle.live_peak[g] for g in names)
    usable = max(live, oracle.peak["kv"] // 4)
    blocks = dict.fromkeys(names, usable + 1)
    manager = ManagerModel(layout, blocks, TINY.max_num_seqs, TINY.max_model_len, share_pools=True)
    run = simulate(TINY, convs, manager)
    key_at = prefix_sim._stream_keys(convs, 16)
    lru_model = LruModel(layout, usable * int(layout.bytes_per_block("kv")), key_at)
    lru = simulate(TINY, convs, lru_model)
    assert {f for f, n in manager.evictions.items() if n > 0} == families
    assert run.prompts == lru.prompts
    assert all(k >= v for k, v in zip(run.hits, lru.hits, strict=True))
    assert all(manager.evictions[f] <= lru_model.evictions[f] for f in families)
    if families == {"history"}:
        assert run.hits == lru.hits and manager.evictions == lru_model.evictions
    else:
        assert sum(run.hits) > sum(lru.hits)
    assert run.hit_tokens < sum(run.prompts)


def test_benchmark_script_kvforge_only(tmp_path, monkeypatch) -> None:
    # the script's run on the tiny workload (the default one takes minutes)
    import bench_prefix

    monkeypatch.setattr(bench_prefix, "run_prefix_bench", _tiny_bench)
    path = tmp_path / "prefix.json"
    argv = ["--no-vllm", "--no-progress", "--repeats", "2", "--models", "llama-3-8b"]
    assert bench_prefix.main([*argv, "--json", str(path)]) == 0
    data = json.loads(path.read_text())
    assert set(data) == {"environment", "cost", "runs"}
    runs = data["runs"]
    assert [(r["model"], r["fraction"]) for r in runs] == [
        ("llama-3-8b", "1"),
        ("llama-3-8b", "1/4"),
    ]
    assert all(r["vllm_hash_us"] is None and r["hash_lookup_ratio"] is None for r in runs)
    assert runs[0]["hit_rate"] == runs[0]["oracle_hit_rate"]
    # the runs carry their model's cost record's figures (they measure none themselves)
    [cost] = data["cost"]
    assert all(
        r["hash_us"] == cost["kvforge_hash_us"] and r["lookup_us"] == cost["kvforge_lookup_us"]
        for r in runs
    )


def _tiny_bench(wl, models=None, fractions=None, cost_repeats=200, **kw):
    assert cost_repeats == 0 and kw.get("vllm_cost") is None
    return run_prefix_bench(
        TINY, ("llama-3-8b",), {"llama-3-8b": FRACTIONS}, cost_repeats=cost_repeats
    )


COST_FIELDS = {
    "model",
    "kvforge_lookup_us",
    "kvforge_hash_us",
    "vllm_hash_us",
    "vllm_lookup_us",
    "ratio",
}


def test_cost_records_kvforge_side(tmp_path, monkeypatch) -> None:
    """``--cost-only``: one cost record per model, kvforge's figures measured, vLLM's null
    (no vLLM in this environment, and ``--no-vllm``); no hit-rate run."""
    import bench_prefix

    def no_runs(*args, **kwargs):
        raise AssertionError("--cost-only ran the hit-rate simulation")

    monkeypatch.setattr(bench_prefix, "run_prefix_bench", no_runs)
    path = tmp_path / "cost.json"
    argv = ["--no-vllm", "--no-progress", "--cost-only", "--repeats", "2"]
    models = "llama-3-8b,deepseek-v4-flash"
    assert bench_prefix.main([*argv, "--models", models, "--json", str(path)]) == 0
    data = json.loads(path.read_text())
    assert data["runs"] == []
    assert data["environment"]["vllm"] is None
    assert len(data["environment"]["load_before"]) == 3
    cost = data["cost"]
    assert [c["model"] for c in cost] == ["llama-3-8b", "deepseek-v4-flash"]
    for c in cost:
        assert set(c) >= COST_FIELDS
        assert c["kvforge_hash_us"] > 0 and c["kvforge_lookup_us"] > 0
        assert c["vllm_hash_us"] is None and c["vllm_lookup_us"] is None
        assert c["ratio"] is None and c["vllm_groups"] is None
        assert c["prompt_tokens"] == 2048 and c["repeats"] == 2
    # the BlockManager's unit and the full hit of 2,047 tokens at each model's boundary
    assert [(c["kvforge_unit"], c["kvforge_hit_tokens"]) for c in cost] == [
        (16, 2032),
        (256, 1792),
    ]


class _FakeRounds:
    """Stands in for ``vllm_baseline.VllmPrefixRounds``."""

    def __init__(self) -> None:
        self.calls = 0
        self.inside = False

    def __enter__(self):
        self.inside = True
        return self

    def __exit__(self, *exc):
        self.inside = False

    def __call__(self) -> None:
        assert self.inside
        self.calls += 1

    def figures(self) -> dict:
        return {
            "hash_us": 100.0,
            "lookup_us": 20.0,
            "hit_tokens": 2032,
            "hash_block_size": 16,
            "scheduler_block_size": 16,
            "groups": ["FullAttentionSpec block 16, 32 layers"],
        }


def test_cost_ratio_is_kvforge_lookup_over_vllm_hash_plus_lookup(monkeypatch) -> None:
    """vLLM's rounds run between kvforge's, one per round; ratio = kvforge lookup / (vLLM hash
    + vLLM lookup); a model without a vLLM config gets kvforge's figures only."""
    import bench_prefix

    def fake_measure_cost(layout, prompt_len, repeats, interleave=None):
        for _ in range(repeats + 1):
            if interleave is not None:
                interleave()
        return 10.0, 30.0

    monkeypatch.setattr(bench_prefix, "measure_cost", fake_measure_cost)
    made: dict[str, _FakeRounds | None] = {}

    def fake_vllm(model, prompt_len):
        assert prompt_len == 2048
        made[model] = None if model == "gpt-oss-20b" else _FakeRounds()
        return made[model]

    records = bench_prefix.measure_costs(("llama-3-8b", "gpt-oss-20b"), 3, fake_vllm)
    assert made["llama-3-8b"].calls == 4 and made["gpt-oss-20b"] is None
    llama, gpt_oss = records
    assert (llama.kvforge_hash_us, llama.kvforge_lookup_us) == (10.0, 30.0)
    assert (llama.vllm_hash_us, llama.vllm_lookup_us) == (100.0, 20.0)
    assert llama.ratio == pytest.approx(30.0 / 120.0)
    assert llama.vllm_hit_tokens == llama.kvforge_hit_tokens == 2032
    assert gpt_oss.ratio is None and gpt_oss.vllm_hash_us is None
    assert (gpt_oss.kvforge_hash_us, gpt_oss.kvforge_lookup_us) == (10.0, 30.0)


def test_measure_cost_interleaves_once_per_round() -> None:
    calls = []
    hash_us, lookup_us = prefix_sim.measure_cost(
        build_layout("llama-3-8b"), 256, 3, interleave=lambda: calls.append(1)
    )
    assert len(calls) == 4  # the warm-up round included
    assert hash_us > 0 and lookup_us > 0
