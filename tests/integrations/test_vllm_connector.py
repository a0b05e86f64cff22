"""kvforge inside vLLM: vLLM 0.33's real ``Scheduler`` with ``KVForgeConnector`` in both roles
(tests/integrations/vllm_harness.py), on CPU.

Request A runs and is offloaded; vLLM's prefix cache is reset; request B with A's prompt gets
its prefix from kvforge's host pages (an external hit vLLM's scheduler counts), B's blocks hold
A's bytes exactly, and B's tokens (a fake model that reads every context byte) equal A's.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip(
    "vllm", reason="vLLM is not installed: pip install 'kvforge[vllm]' (docs/integrations/vllm.md)"
)
sys.path.insert(0, str(Path(__file__).parent))

from vllm_harness import build_offload_engine

from kvforge.integrations.vllm import KVForgeConnector

#: model -> (block size, GPU blocks, max_model_len)
SHAPES = {"llama": (16, 64, 256), "gpt-oss": (16, 64, 256), "deepseek-v4": (256, 480, 1024)}


def engine(model: str, host_bytes: int = 64 << 20, **kw):
    _, blocks, max_len = SHAPES[model]
    return build_offload_engine(
        model,
        num_gpu_blocks=kw.pop("num_gpu_blocks", blocks),
        kv_connector="KVForgeConnector",
        kv_connector_module_path="kvforge.integrations.vllm",
        extra_config={"kvforge": {"host_bytes": host_bytes}},
        max_model_len=max_len,
        **kw,
    )


def prompt(model: str, blocks: int = 3, seed: int = 0) -> list[int]:
    size = SHAPES[model][0]
    return [(i * 7 + 3 + seed * 101) % 997 for i in range(size * blocks + 5)]


def parts(eng):
    connector = eng.scheduler_connector
    assert isinstance(connector, KVForgeConnector)
    manager = connector.connector_scheduler.manager
    worker = eng.worker_connector.connector_worker.worker
    return manager, worker


def num_groups(eng) -> int:
    return len(eng.scheduler_kv_cache_config.kv_cache_groups)


@pytest.mark.parametrize("model", list(SHAPES))
def test_b_receives_a_bytes_from_host_pages_after_a_prefix_cache_reset(model):
    eng = engine(model)
    p = prompt(model)
    eng.add_request("A", p, 3)
    out_a = eng.run_until_done()["A"]
    manager, worker = parts(eng)
    assert worker.bytes_stored > 0 and worker.failed_transfers == 0
    assert eng.reset_prefix_cache()
    eng.add_request("B", p, 3)
    out_b = eng.run_until_done()["B"]
    # the hit came from kvforge: vLLM's scheduler took external tokens, the worker loaded them
    block = SHAPES[model][0]
    assert eng.num_external_computed_tokens["B"] == block * 3  # every full block of the prompt
    assert worker.bytes_loaded > 0
    assert out_b == out_a
    a, b = eng.snapshots["A"], eng.snapshots["B"]
    compared = 0
    for g in range(num_groups(eng)):
        for x, y in zip(a[g], b[g], strict=False):
            if x is not None and y is not None:
                assert x == y, f"group {g}"
                compared += 1
    assert compared >= 3
    assert manager.stores_failed == 0


def test_host_bytes_per_token_are_the_groups_unpadded_pages():
    # DeepSeek-V4: a row of a group's pages holds that group's layers' unpadded pages, nothing
    # more; vLLM's own CPU spec gives every key a chunk of the whole packed block
    eng = engine("deepseek-v4")
    manager, worker = parts(eng)
    config = eng.kv_cache_config  # the worker's: every layer's own spec
    unpadded = []
    for gid in manager.plan.group_ids:
        group = config.kv_cache_groups[gid]
        layers = getattr(group.kv_cache_spec, "kv_cache_specs", None) or {}
        unpadded.append(
            sum(
                layers.get(n, group.kv_cache_spec).unpadded_page_size_bytes
                for n in group.layer_names
            )
        )
    assert worker.block_bytes == unpadded
    assert [h.shape[1] for h in worker.host] == unpadded
    packed = config.kv_cache_tensors[0].size // config.num_blocks
    assert sum(unpadded) < len(unpadded) * packed
    eng.add_request("A", prompt("deepseek-v4"), 2)
    eng.run_until_done()
    held = manager.held()
    # every stored block took exactly its group's unpadded bytes: no padding crossed
    assert (
        worker.bytes_stored
        == sum(held[g] * b for g, b in zip(manager.plan.group_ids, unpadded, strict=True))
        > 0
    )


def test_an_injected_load_failure_recomputes_and_the_tokens_equal(monkeypatch):
    import kvforge.integrations.vllm.worker as worker_module

    eng = engine("gpt-oss")
    p = prompt("gpt-oss")
    eng.add_request("A", p, 4)
    out_a = eng.run_until_done()["A"]
    assert eng.reset_prefix_cache()
    real = worker_module.scatter_blocks
    calls = []

    def broken(*args, **kwargs):
        calls.append(1)
        raise RuntimeError("injected: the host link went down")

    monkeypatch.setattr(worker_module, "scatter_blocks", broken)
    eng.add_request("B", p, 4)
    out_b = eng.run_until_done()["B"]
    monkeypatch.setattr(worker_module, "scatter_blocks", real)
    manager, worker = parts(eng)
    assert calls and worker.failed_transfers >= 1
    assert out_b == out_a  # recomputed, not garbage
    assert not manager._pins  # the failed load's pins were released
    # and the pages still serve a later request
    assert eng.reset_prefix_cache()
    eng.add_request("C", p, 4)
    assert eng.run_until_done()["C"] == out_a
    assert worker.bytes_loaded > 0


def test_an_injected_store_failure_is_dropped_and_counted(monkeypatch):
    import kvforge.integrations.vllm.worker as worker_module

    def broken(*args, **kwargs):
        raise RuntimeError("injected: host pages unwritable")

    monkeypatch.setattr(worker_module, "gather_blocks", broken)
    eng = engine("llama")
    p = prompt("llama")
    eng.add_request("A", p, 3)
    out_a = eng.run_until_done()["A"]
    manager, worker = parts(eng)
    assert worker.failed_transfers >= 1 and worker.bytes_stored == 0
    assert manager.stores_failed >= 3 and manager.held() == {0: 0}
    monkeypatch.undo()
    assert eng.reset_prefix_cache()
    eng.add_request("B", p, 3)
    assert eng.run_until_done()["B"] == out_a
    assert eng.num_external_computed_tokens["B"] == 0  # nothing was served from a failed store


def test_eviction_under_a_small_host_budget():
    block_bytes = 32_768  # the Llama shape's block, every layer
    eng = engine("llama", host_bytes=block_bytes * 6)
    manager, _ = parts(eng)
    assert manager.plan.num_pages == 6
    prompts = [prompt("llama", 3, seed) for seed in range(3)]
    outs = []
    for i, p in enumerate(prompts):
        eng.add_request(f"R{i}", p, 2)
        outs.append(eng.run_until_done()[f"R{i}"])
    assert manager.held() == {0: 6}  # 3 prompts x 3 blocks on 6 pages: the oldest went
    assert eng.reset_prefix_cache()
    eng.add_request("late", prompts[2], 2)
    eng.add_request("early", prompts[0], 2)
    done = eng.run_until_done()
    assert done["late"] == outs[2] and done["early"] == outs[0]
    assert eng.num_external_computed_tokens["late"] >= 3 * 16 - 16
    assert eng.num_external_computed_tokens["early"] < eng.num_external_computed_tokens["late"]


def test_a_store_that_does_not_fit_stores_nothing():
    eng = engine("llama", host_bytes=32_768 * 2)  # 2 pages, the prompt completes 4 blocks
    manager, worker = parts(eng)
    eng.add_request("A", prompt("llama", 4), 2)
    eng.run_until_done()
    assert manager.allocation_failures >= 1
    assert manager.held() == {0: 0} and worker.bytes_stored == 0


@pytest.mark.parametrize(
    ("connector", "extra", "message"),
    [
        ("KVForgeConnector", {"kvforge": {"host_bytes": 1}}, "host_bytes=1 holds no chunk"),
        (
            "KVForgeConnector",
            {"kvforge": {"nope": 1}},
            r"kvforge option 'nope'=1: no such option; kvforge's options are 'host_bytes'",
        ),
        (
            "KVForgeConnector",
            {"spec_name": "CPUOffloadingSpec"},
            r"\['spec_name'\] must be 'KVForgeOffloadingSpec' .* got 'CPUOffloadingSpec'",
        ),
        ("KVForgeConnector", {"canonical_layout": True}, r"\['canonical_layout'\] must be false"),
        (
            "KVForgeConnector",
            {"sync_load_budget_bytes": 1 << 20},
            r"\['sync_load_budget_bytes'\] must be 0 with kvforge: .* got 1048576",
        ),
        ("KVForgeConnector", {"sync_load_budget_bytes": "lots"}, r"must be 0 .* got 'lots'"),
        (
            "OffloadingConnector",
            {
                "spec_name": "KVForgeOffloadingSpec",
                "spec_module_path": "kvforge.integrations.vllm.spec",
            },
            "needs each group's unpadded block bytes, which vLLM's OffloadingConnector does not pass",
        ),
    ],
)
def test_bad_configurations_are_refused_with_the_key_and_value(connector, extra, message):
    from kvforge._checks import ArgumentError

    with pytest.raises(ArgumentError, match=message):
        build_offload_engine(
            "llama",
            num_gpu_blocks=64,
            kv_connector=connector,
            kv_connector_module_path=(
                "kvforge.integrations.vllm" if connector == "KVForgeConnector" else None
            ),
            extra_config=extra,
        )
