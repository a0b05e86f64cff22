"""The prefix benchmark against vLLM (``prefix_vs_vllm``): the engine loop's policy on a fake
cache, the kvforge side on a tiny seeded workload, kvforge's sizing against a real controller,
the command line and its JSON without vLLM. The vLLM half runs only where vLLM is installed
(``pytest.importorskip``). No timing is asserted."""

from __future__ import annotations

import json
from collections.abc import Sequence
from fractions import Fraction

import numpy as np
import prefix_vs_vllm as pv
import pytest
from prefix_sim import make_conversations
from prefix_vs_vllm import (
    FcfsEngine,
    KvforgeSide,
    SimRequest,
    kvforge_backends,
    kvforge_manager,
    parse_kvforge_options,
    prefix_workload,
    run_conversations,
    run_prefix_vs_vllm,
    short_reason,
)

from kvforge import CacheController

QUICK = prefix_workload(seed=0, quick=True)
ENGINE = {
    "max_model_len": QUICK.max_model_len,
    "max_num_seqs": QUICK.max_num_seqs,
    "max_num_batched_tokens": QUICK.max_num_batched_tokens,
}


# --- the engine loop on a fake cache ----------------------------------------------------------


class FakeSide:
    """One pool of ``capacity`` token slots, no prefix cache; records every call."""

    name = "fake"

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.held: dict[str, int] = {}
        self.calls: list[tuple[str, str, int]] = []

    def _free(self) -> int:
        return self.capacity - sum(self.held.values())

    def begin_step(self) -> None:
        self.calls.append(("step", "", 0))

    def lookup(self, r: SimRequest) -> tuple[int, object]:
        return 0, None

    def admit(self, r, n, hit, handle, has_scheduled) -> bool:
        self.calls.append(("admit", r.rid, n))
        if n > self._free():
            return False
        self.held[r.rid] = n
        return True

    def grow(self, r: SimRequest, n: int) -> bool:
        self.calls.append(("grow", r.rid, n))
        if n > self._free():
            return False
        self.held[r.rid] += n
        return True

    def preempt(self, r: SimRequest) -> None:
        self.calls.append(("preempt", r.rid, 0))
        del self.held[r.rid]

    def end_step(self, scheduled: Sequence[tuple[SimRequest, int]]) -> None:
        pass

    def settle(self, r: SimRequest, n: int, sampled: bool) -> None:
        pass

    def finish(self, r: SimRequest) -> None:
        self.calls.append(("finish", r.rid, 0))
        del self.held[r.rid]


def _req(rid: str, prompt: int, output: int) -> SimRequest:
    return SimRequest(rid, np.arange(prompt + output), prompt, output)


def test_engine_chunks_samples_and_finishes() -> None:
    side = FakeSide(1000)
    engine = FcfsEngine(
        side,
        max_num_seqs=4,
        max_num_batched_tokens=64,
        max_model_len=512,
        long_prefill_token_threshold=0,
    )
    r = _req("a", 100, 3)
    engine.add(r)
    out = engine.step()  # one request alone: the whole budget, no per-request cap
    assert [(x.rid, n) for x, n in out.scheduled] == [("a", 64)]
    assert r.computed == 64 and r.num_tokens == 100 and not out.finished
    engine.step()  # the rest of the prompt, then the first sampled token
    assert r.computed == 100 and r.num_tokens == 101 and r.hit == 0
    engine.step()
    out = engine.step()  # the third output token finishes it; its KV is never computed
    assert out.finished == [r] and r.num_tokens == 103 and r.computed == 102
    assert not engine.has_requests() and side.held == {}


def test_engine_caps_chunks_only_with_several_requests() -> None:
    engine = FcfsEngine(FakeSide(10_000), 4, 1000, 4096, long_prefill_token_threshold=100)
    a, b = _req("a", 500, 2), _req("b", 500, 2)
    engine.add(a)
    engine.add(b)
    out = engine.step()
    assert [(x.rid, n) for x, n in out.scheduled] == [("a", 100), ("b", 100)]
    solo = FcfsEngine(FakeSide(10_000), 4, 1000, 4096, long_prefill_token_threshold=100)
    c = _req("c", 500, 2)
    solo.add(c)
    assert [n for _, n in solo.step().scheduled] == [500]


def test_engine_stops_admitting_at_the_first_misfit_and_respects_rows() -> None:
    side = FakeSide(100)
    engine = FcfsEngine(side, max_num_seqs=2, max_num_batched_tokens=1000, max_model_len=512)
    for rid, p in (("a", 40), ("b", 80), ("c", 10)):
        engine.add(_req(rid, p, 4))
    out = engine.step()
    # a fits, b does not, and c (which would fit) waits behind it: first come, first served
    assert [x.rid for x, _ in out.scheduled] == ["a"]
    assert [x.rid for x in engine.waiting] == ["b", "c"]
    rows = FcfsEngine(
        FakeSide(10_000), max_num_seqs=2, max_num_batched_tokens=1000, max_model_len=512
    )
    for rid in "xyz":
        rows.add(_req(rid, 10, 4))
    assert [x.rid for x, _ in rows.step().scheduled] == ["x", "y"]


def test_engine_preempts_the_newest_and_admits_nothing_in_that_step() -> None:
    side = FakeSide(100)
    engine = FcfsEngine(side, max_num_seqs=4, max_num_batched_tokens=1000, max_model_len=512)
    a, b = _req("a", 50, 20), _req("b", 49, 20)
    engine.add(a)
    engine.add(b)
    engine.step()  # both prompts: 99 of 100 slots, both sample
    engine.add(_req("c", 1, 5))
    out = engine.step()  # a grows (100 of 100); b cannot: b, the newest, is preempted
    assert [x.rid for x, _ in out.scheduled] == ["a"]
    assert out.preempted == [b] and b.computed == 0 and b.preemptions == 1
    assert [x.rid for x in engine.waiting] == ["b", "c"]  # no admission in a preempting step
    assert ("admit", "c", 1) not in side.calls
    # b keeps its sampled token and recomputes its prompt plus it when it comes back
    assert b.num_tokens == 50


def test_request_stream_must_hold_its_output() -> None:
    with pytest.raises(ValueError, match="shorter than prompt"):
        SimRequest("r", np.arange(10), 8, 5)


# --- kvforge's side ---------------------------------------------------------------------------


#: a small engine, so every model plans in a few tens of MiB of real CPU memory
SMALL = {"max_model_len": 256, "max_num_seqs": 2, "max_num_batched_tokens": 128}


def _budget(model: str, engine: dict[str, int] = SMALL) -> int:
    """The smallest of a few budgets kvforge can plan ``model`` in, for ``engine``."""
    from kvforge import CacheLayout, plan_memory

    layout = CacheLayout(kvforge_backends(model))
    for mib in (8, 16, 32, 64, 128, 256, 512):
        try:
            plan_memory(
                layout,
                mib << 20,
                engine["max_num_seqs"],
                engine["max_model_len"],
                engine["max_num_batched_tokens"],
            )
        except ValueError:
            continue
        return mib << 20
    raise AssertionError(f"{model}: no budget found")


@pytest.mark.parametrize("model", pv.MODELS)
def test_kvforge_manager_is_sized_as_the_controller_sizes_it(model: str) -> None:
    """The benchmark builds kvforge's scheduler side without device memory; its pools must be
    the ones ``CacheController.initialize_kv_cache(memory_budget=...)`` gives (this fails, and
    says so, if the controller's sizing path changes and the benchmark does not follow)."""
    budget = _budget(model)
    manager, info = kvforge_manager(model, budget, enable_prefix_caching=True, **SMALL)
    ctl = CacheController(kvforge_backends(model), device="cpu", enable_prefix_caching=True)
    try:
        ctl.initialize_kv_cache(memory_budget=budget, **SMALL)
        real = ctl.scheduler
        for g in real.groups:
            assert manager.pool(g).num_blocks == real.pool(g).num_blocks, g
            assert (manager.pool(g) is manager.pool(real.groups[0])) == (
                real.pool(g) is real.pool(real.groups[0])
            ), f"{g}: pool sharing differs from the controller's"
        assert manager.max_num_seqs == real.max_num_seqs
        assert manager.max_model_len == real.max_model_len
        assert manager.prefix_caching and real.prefix_caching
    finally:
        ctl.free()
    assert info["plan_bytes"] <= budget
    assert set(info["pools"]) and all(n >= 2 for n in info["pools"].values())


def test_kvforge_options_go_where_they_are_taken() -> None:
    assert parse_kvforge_options(["share_pools=True", "x=abc", "n=3"]) == {
        "share_pools": True,
        "x": "abc",
        "n": 3,
    }
    with pytest.raises(ValueError, match="NAME=VALUE"):
        parse_kvforge_options(["nonsense"])
    budget = _budget("gpt-oss-20b", ENGINE)
    _, shared = kvforge_manager(
        "gpt-oss-20b",
        budget,
        enable_prefix_caching=True,
        options={"share_pools": True},
        **ENGINE,
    )
    assert set(shared["pools"]) == {"swa+kv"} and shared["share_pools"] is True
    _, alone = kvforge_manager(
        "gpt-oss-20b",
        budget,
        enable_prefix_caching=True,
        options={"share_pools": False},
        **ENGINE,
    )
    assert set(alone["pools"]) == {"swa", "kv"}
    with pytest.raises(ValueError, match="taken by neither"):
        kvforge_manager(
            "llama-3-8b",
            budget,
            enable_prefix_caching=True,
            options={"no_such_option": 1},
            **ENGINE,
        )


@pytest.fixture(scope="module")
def kvforge_rows() -> list[pv.PrefixRow]:
    return run_prefix_vs_vllm(
        QUICK, ("llama-3-8b", "gpt-oss-20b"), (Fraction(1, 2), Fraction(4)), with_vllm=False
    )


def test_kvforge_rows_without_vllm(kvforge_rows: list[pv.PrefixRow]) -> None:
    convs = make_conversations(QUICK)
    prompts = sum(sum(c.prompt_lens) for c in convs)
    assert [(r.model, r.size) for r in kvforge_rows] == [
        (m, s) for m in ("llama-3-8b", "gpt-oss-20b") for s in ("1/2", "unbounded")
    ]
    for r in kvforge_rows:
        assert r.vllm_default_hit_tokens is None and r.vllm_dense_hit_tokens is None
        assert r.ratio_default is None and r.ratio_dense is None
        assert r.prompt_tokens == prompts and 0 < r.kvforge_hit_tokens < prompts
        assert r.kvforge_plan_bytes <= r.memory_bytes
        assert r.runs["kvforge"]["turns"] == sum(len(c.prompt_lens) for c in convs)
    # more memory never serves fewer hits here, and every Llama hit is whole 16-token blocks
    for model in ("llama-3-8b", "gpt-oss-20b"):
        half, unbounded = [r for r in kvforge_rows if r.model == model]
        assert unbounded.kvforge_hit_tokens >= half.kvforge_hit_tokens
        assert unbounded.memory_bytes == 8 * half.memory_bytes


def test_hits_are_block_aligned_and_deterministic() -> None:
    convs = make_conversations(QUICK)
    budget = _budget("llama-3-8b", ENGINE) * 4
    results = []
    for _ in range(2):
        manager, _ = kvforge_manager("llama-3-8b", budget, enable_prefix_caching=True, **ENGINE)
        side = KvforgeSide(manager)
        results.append(run_conversations(QUICK, convs, side))
    a, b = results
    assert (a.hit_tokens, a.steps, a.preemptions) == (b.hit_tokens, b.steps, b.preemptions)
    assert a.hit_tokens % 16 == 0 and a.hit_tokens > 0
    # the system prompt (200 tokens, 192 in whole blocks) is shared: most turns hit it
    assert a.hit_tokens >= a.turns // 2 * (QUICK.system_prompt_len // 16 * 16)


def test_short_reason() -> None:
    long = "To serve at least one request it needs more. " + "x" * 300
    assert short_reason(long) == "To serve at least one request it needs more."
    assert short_reason("a" * 500).endswith("...") and len(short_reason("a" * 500)) == 160


# --- the command line -------------------------------------------------------------------------


def test_main_without_vllm_says_so_and_exits_2(monkeypatch, capsys) -> None:
    monkeypatch.setattr(pv, "vllm_available", lambda: False)
    assert pv.main(["--quick", "--no-progress", "--models", "llama-3-8b"]) == 2
    assert "--no-vllm" in capsys.readouterr().out


def test_main_no_vllm_writes_json(tmp_path, monkeypatch) -> None:
    calls = {}

    def tiny(wl, models, sizes, with_vllm, options, progress, **kw):
        calls.update(models=models, with_vllm=with_vllm, options=options, wl=wl)
        return run_prefix_vs_vllm(wl, models, (Fraction(4),), with_vllm, options, progress)

    monkeypatch.setattr(pv, "run_prefix_vs_vllm", tiny)
    path = tmp_path / "prefix.json"
    argv = [
        "--quick",
        "--no-vllm",
        "--no-progress",
        "--models",
        "llama-3-8b",
        "--seed",
        "3",
        "--kvforge-option",
        "share_pools=False",
        "--json",
        str(path),
    ]
    assert pv.main(argv) == 0
    assert calls["models"] == ["llama-3-8b"] and calls["with_vllm"] is False
    assert calls["options"] == {"share_pools": False} and calls["wl"].seed == 3
    data = json.loads(path.read_text())
    assert set(data) == {"environment", "workload", "kvforge", "rows"}
    assert data["environment"]["vllm"] is None and data["workload"]["seed"] == 3
    assert data["kvforge"]["options"] == {"share_pools": False}
    assert "share_pools" in data["kvforge"]["controller"]
    [row] = data["rows"]
    assert row["model"] == "llama-3-8b" and row["size"] == "unbounded"
    assert row["kvforge_hit_tokens"] > 0 and row["vllm_default_hit_tokens"] is None


def test_main_refuses_unknown_models() -> None:
    with pytest.raises(SystemExit):
        pv.main(["--no-vllm", "--models", "gpt-5"])


# --- the vLLM half (only where vLLM is installed) --------------------------------------------


def test_vllm_and_kvforge_agree_on_llama() -> None:
    """Llama-3-8B has one full-attention group: vLLM's pool and kvforge's are both one LRU
    over the same bytes, so every side serves the same hits at every size."""
    pytest.importorskip("vllm")
    rows = run_prefix_vs_vllm(QUICK, ("llama-3-8b",), (Fraction(1, 2), Fraction(4)))
    for r in rows:
        assert r.vllm_default_hit_tokens == r.vllm_dense_hit_tokens == r.kvforge_hit_tokens
        # the manager runs are what vLLM's real Scheduler serves on the same conversations
        assert r.scheduler_check == {"vllm_default": True, "vllm_dense": True}
        assert r.memory_bytes == r.vllm_num_blocks * r.vllm_bytes_per_block
        assert r.kvforge_pool_bytes <= r.memory_bytes
    assert rows[-1].runs["vllm_dense_every_block"]["hit_tokens"] == rows[-1].vllm_dense_hit_tokens


def test_vllm_sizes_hybrid_models_with_one_pool() -> None:
    pytest.importorskip("vllm")
    import vllm_baseline as vb

    setup = vb.build_vllm_cache_setup("gemma-2-9b", 1 << 30, **ENGINE)
    assert setup.groups == (
        "SlidingWindowSpec block 16 window 4096, 21 layers",
        "FullAttentionSpec block 16, 21 layers",
    )
    # a block is 21 layers' pages (K and V, 8 heads x 256 dims, bf16, 16 tokens); the window
    # group's layers and the full group's alias the same bytes, one group per block at a time
    assert setup.bytes_per_block == 21 * 2 * 16 * 8 * 256 * 2
    assert setup.memory_bytes == setup.num_blocks * setup.bytes_per_block <= 1 << 30


@pytest.mark.parametrize("model", ["gpt-oss-20b", "mistral-7b-v0.1", "deepseek-v4-tiny"])
def test_manager_runs_are_what_vllms_scheduler_serves(model: str) -> None:
    """On hybrid and all-window models, with both retentions and under pressure, driving vLLM's
    ``KVCacheManager`` as the loop does gives what vLLM's real ``Scheduler`` gives."""
    pytest.importorskip("vllm")
    import vllm_baseline as vb

    convs = make_conversations(QUICK)
    args = dict(ENGINE, long_prefill_token_threshold=QUICK.chunk_size)
    for retention in (vb.RETENTION_DEFAULT, vb.RETENTION_DENSE):
        for memory in (140 << 20, 1 << 30):
            try:
                setup = vb.build_vllm_cache_setup(
                    model, memory, retention_interval=retention, **args
                )
            except ValueError:  # vLLM refuses a budget below one max_model_len request
                continue
            mine = run_conversations(QUICK, convs, pv.VllmManagerSide(setup))
            setup = vb.build_vllm_cache_setup(model, memory, retention_interval=retention, **args)
            real = pv.run_conversations_on_scheduler(QUICK, convs, setup)
            assert (mine.hit_tokens, mine.steps, mine.preemptions, mine.max_running) == (
                real.hit_tokens,
                real.steps,
                real.preemptions,
                real.max_running,
            )
