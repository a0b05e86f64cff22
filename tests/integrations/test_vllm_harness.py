"""Self-test of :mod:`vllm_harness` with vLLM's own ``OffloadingConnector``.

vLLM's ``CPUOffloadingSpec`` worker cannot run on CPU tensors even with the platform check
patched: ``SingleDirectionOffloadingHandler`` asserts ``gpu_tensor.is_cuda`` and copies on
CUDA streams / events (``vllm/v1/kv_offload/cpu/gpu_worker.py``). So the spec used here,
:class:`TorchCPUOffloadingSpec`, is ``CPUOffloadingSpec`` (its real ``CPUOffloadingManager`` on
the scheduler side) whose worker is :class:`TorchCopyWorker`: a synchronous torch port of
``CPUOffloadingWorker``'s direct layout (one CPU tensor ``[num_chunks, page * blocks_per_chunk]``
per canonical GPU tensor; per group and per ``CanonicalKVCacheRef`` one page copy per block,
skipping ``block_indices[g] % blocks_per_chunk`` sub-blocks in the first chunk, as
``SingleDirectionOffloadingHandler.transfer_async`` does). It is loaded out of tree
(``spec_name`` / ``spec_module_path``), purely to validate the harness.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM 0.33 is not installed (see docs/vllm_baseline.md)")

import torch
from vllm.v1.kv_offload.base import (
    BlockIDsLoadStoreSpec,
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec
from vllm_harness import OffloadEngine, build_offload_engine


@dataclass
class TransferRecord:
    """One transfer the worker ran (for tests and for the spec author's reference)."""

    kind: str  # "store" or "load"
    job_id: int
    gpu_block_ids: list[int]
    group_sizes: list[int]
    block_indices: list[int]
    cpu_chunk_ids: list[int]
    num_bytes: int


class TorchCopyWorker(OffloadingWorker):
    """``CPUOffloadingWorker`` (direct layout) as synchronous torch copies on CPU."""

    def __init__(self, kv_caches: CanonicalKVCaches, blocks_per_chunk: int, num_chunks: int):
        self.kv_caches = kv_caches
        self.blocks_per_chunk = blocks_per_chunk
        self.gpu_tensors = [
            t.tensor.view(torch.int8).view(-1, t.page_size_bytes)
            if t.tensor.is_contiguous()
            else t.tensor.view(torch.int8)
            for t in kv_caches.tensors
        ]
        self.cpu_tensors = [
            torch.zeros(num_chunks, t.page_size_bytes * blocks_per_chunk, dtype=torch.int8)
            for t in kv_caches.tensors
        ]
        self.records: list[TransferRecord] = []
        self._finished: list[TransferResult] = []

    def _transfer(
        self, job_id: int, gpu: GPULoadStoreSpec, cpu: LoadStoreSpec, store: bool
    ) -> bool:
        assert isinstance(cpu, BlockIDsLoadStoreSpec)
        start = time.perf_counter()
        bpc = self.blocks_per_chunk
        gpu_ids = [int(b) for b in gpu.block_ids]
        cpu_ids = [int(c) for c in cpu.block_ids]
        gpu_off = cpu_off = 0
        num_bytes = 0
        for g, (size, block_idx) in enumerate(zip(gpu.group_sizes, gpu.block_indices, strict=True)):
            if size == 0:
                continue
            skip = block_idx % bpc
            n_chunks = -(-(size + skip) // bpc)
            for j in range(size):
                gpu_block = gpu_ids[gpu_off + j]
                chunk = cpu_ids[cpu_off + (j + skip) // bpc]
                sub = (j + skip) % bpc
                for ref in self.kv_caches.group_data_refs[g]:
                    page = self.kv_caches.tensors[ref.tensor_idx].page_size_bytes
                    src = self.gpu_tensors[ref.tensor_idx][gpu_block, : ref.page_size_bytes]
                    dst = self.cpu_tensors[ref.tensor_idx][
                        chunk, sub * page : sub * page + ref.page_size_bytes
                    ]
                    if store:
                        dst.copy_(src)
                    else:
                        src.copy_(dst)
                    num_bytes += ref.page_size_bytes
            gpu_off += size
            cpu_off += n_chunks
        assert gpu_off == len(gpu_ids) and cpu_off == len(cpu_ids)
        self.records.append(
            TransferRecord(
                "store" if store else "load",
                job_id,
                gpu_ids,
                list(gpu.group_sizes),
                list(gpu.block_indices),
                cpu_ids,
                num_bytes,
            )
        )
        self._finished.append(TransferResult(job_id, True, num_bytes, time.perf_counter() - start))
        return True

    def submit_store(
        self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec
    ) -> bool:
        return self._transfer(job_id, src_spec, dst_spec, store=True)

    def submit_load(
        self,
        job_id: int,
        src_spec: LoadStoreSpec,
        dst_spec: GPULoadStoreSpec,
        expedited: bool = False,
    ) -> bool:
        return self._transfer(job_id, dst_spec, src_spec, store=False)

    def get_finished(self) -> list[TransferResult]:
        finished, self._finished = self._finished, []
        return finished

    def wait(self, job_ids: set[int]) -> None:
        return


class TorchCPUOffloadingSpec(CPUOffloadingSpec):
    """vLLM's ``CPUOffloadingSpec`` with :class:`TorchCopyWorker` as its worker."""

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self._worker is None:
            self._worker = TorchCopyWorker(  # type: ignore[assignment]
                kv_caches, self.blocks_per_chunk, self.num_chunks
            )
        return self._worker  # type: ignore[return-value]


def _engine(model: str, **kwargs: Any) -> OffloadEngine:
    return build_offload_engine(
        model,
        kv_connector="OffloadingConnector",
        kv_connector_module_path=None,
        extra_config={
            "cpu_bytes_to_use": 64 << 20,
            "spec_name": TorchCPUOffloadingSpec.__name__,
            "spec_module_path": __name__,
        },
        **kwargs,
    )


def _worker(engine: OffloadEngine) -> TorchCopyWorker:
    worker = engine.worker_connector.connector_worker.worker
    assert isinstance(worker, TorchCopyWorker)
    return worker


def _prompt(n: int, seed: int = 1) -> list[int]:
    return [(seed * 7919 + i * 31) % 997 + 1 for i in range(n)]


def _expected_bytes(worker: TorchCopyWorker, record: TransferRecord) -> int:
    """Per group, blocks x the unpadded pages of the group's canonical refs."""
    refs = worker.kv_caches.group_data_refs
    return sum(
        size * sum(ref.page_size_bytes for ref in refs[g])
        for g, size in enumerate(record.group_sizes)
    )


#: model, GPU blocks, block size (the scheduler's hash block), max_model_len
CASES = [
    ("llama", 48, 16, 256),
    ("gpt-oss", 48, 16, 256),
    ("deepseek-v4", 480, 256, 1024),
]


@pytest.mark.parametrize("chunk", [None, 24], ids=["one-shot", "chunked"])
@pytest.mark.parametrize(
    ("model", "num_blocks", "block", "max_len"), CASES, ids=[c[0] for c in CASES]
)
def test_offload_then_load_after_reset(
    model: str, num_blocks: int, block: int, max_len: int, chunk: int | None
) -> None:
    """A runs and is offloaded; vLLM's prefix cache is reset; B (same prompt) loads A's full
    blocks from the tier: same block bytes, same tokens, exact byte counts."""
    kwargs: dict[str, Any] = {"num_gpu_blocks": num_blocks, "max_model_len": max_len}
    if chunk is not None:
        kwargs["max_num_batched_tokens"] = chunk
    engine = _engine(model, **kwargs)
    worker = _worker(engine)
    prompt = _prompt(3 * block + 10)  # 3 full blocks + a partial one
    engine.add_request("A", prompt, max_tokens=5)
    engine.run_until_done()
    out_a = engine.outputs["A"]
    assert len(out_a) == 5
    assert engine.num_external_computed_tokens["A"] == 0
    stores = [r for r in worker.records if r.kind == "store"]
    assert stores, "nothing was offloaded"
    assert not [r for r in worker.records if r.kind == "load"]
    full_attention = [
        g
        for g in range(len(engine.kv_cache_config.kv_cache_groups))
        if all(layer.window is None for layer in engine.group_layers(g))
        and engine.group_layers(g)[0].block_size == block
    ]
    assert full_attention
    for g in full_attention:  # every full prompt block of the hash-block-sized groups
        assert sum(r.group_sizes[g] for r in stores) == 3

    assert engine.reset_prefix_cache()
    engine.add_request("B", prompt, max_tokens=5)
    engine.run_until_done()
    loads = [r for r in worker.records if r.kind == "load"]
    assert loads, "B got no load from the offload tier"
    assert engine.num_external_computed_tokens["B"] == 3 * block
    assert engine.prefill_stats["B"].num_local_cached_tokens == 0
    assert "B" in engine.finished_recving
    assert engine.outputs["B"] == out_a

    for g in range(len(engine.kv_cache_config.kv_cache_groups)):
        a_blocks, b_blocks = engine.block_bytes("A", g), engine.block_bytes("B", g)
        assert len(a_blocks) == len(b_blocks)
        assert any(b is not None for b in b_blocks)
        assert a_blocks == b_blocks

    # exact bytes: the worker's records and what the connector reported to the scheduler
    for r in worker.records:
        assert r.num_bytes == _expected_bytes(worker, r)
    reported_load = sum(m.transfer_stats.load.bytes for m in engine.worker_metas)
    reported_store = sum(m.transfer_stats.store.bytes for m in engine.worker_metas)
    assert reported_load == sum(r.num_bytes for r in loads)
    assert reported_store == sum(r.num_bytes for r in stores)
    engine.shutdown()


def test_wrong_loaded_bytes_change_outputs() -> None:
    """Corrupting the offload tier changes B's tokens (the fake model reads the KV)."""
    engine = _engine("llama", num_gpu_blocks=48)
    worker = _worker(engine)
    prompt = _prompt(3 * 16 + 5, seed=2)
    engine.add_request("A", prompt, max_tokens=4)
    engine.run_until_done()
    for cpu in worker.cpu_tensors:
        cpu.add_(1)
    engine.reset_prefix_cache()
    engine.add_request("B", prompt, max_tokens=4)
    engine.run_until_done()
    assert engine.num_external_computed_tokens["B"] == 48
    assert engine.outputs["B"] != engine.outputs["A"]
    assert engine.block_bytes("B", 0) != engine.block_bytes("A", 0)
    engine.shutdown()


def test_gpu_prefix_hit_needs_no_load() -> None:
    """Without a reset, B's hit is vLLM's own prefix cache: no load, same tokens."""
    engine = _engine("gpt-oss", num_gpu_blocks=48)
    worker = _worker(engine)
    prompt = _prompt(3 * 16 + 5, seed=3)
    engine.add_request("A", prompt, max_tokens=3)
    engine.run_until_done()
    engine.add_request("B", prompt, max_tokens=3)
    engine.run_until_done()
    assert engine.prefill_stats["B"].num_local_cached_tokens == 48
    assert engine.num_external_computed_tokens["B"] == 0
    assert not [r for r in worker.records if r.kind == "load"]
    assert engine.outputs["B"] == engine.outputs["A"]
    engine.shutdown()


def test_concurrent_requests_and_distinct_prompts() -> None:
    """Two requests in one batch with different prompts get different tokens; replaying
    both after a reset loads both and reproduces both."""
    engine = _engine("llama", num_gpu_blocks=64)
    prompts = {"A": _prompt(40, seed=4), "C": _prompt(50, seed=5)}
    for req_id, prompt in prompts.items():
        engine.add_request(req_id, prompt, max_tokens=4)
    engine.run_until_done()
    assert engine.outputs["A"] != engine.outputs["C"]
    engine.reset_prefix_cache()
    for req_id, prompt in prompts.items():
        engine.add_request(req_id + "2", prompt, max_tokens=4)
    engine.run_until_done()
    assert engine.num_external_computed_tokens == {"A": 0, "C": 0, "A2": 32, "C2": 48}
    assert engine.outputs["A2"] == engine.outputs["A"]
    assert engine.outputs["C2"] == engine.outputs["C"]
    engine.shutdown()


def test_preemption_keeps_outputs() -> None:
    """A GPU pool too small for four requests makes vLLM preempt (and resume them as new
    requests carrying their sampled tokens, V2 runner); the tokens match an unconstrained
    run's."""

    def run(num_blocks: int) -> tuple[dict[str, list[int]], int]:
        engine = _engine("llama", num_gpu_blocks=num_blocks, max_model_len=128)
        for i in range(4):
            engine.add_request(f"r{i}", _prompt(70 + i, seed=10 + i), max_tokens=30)
        preempted = 0
        while engine.has_requests():
            preempted += len(engine.step().preempted_req_ids or ())
        engine.shutdown()
        return engine.outputs, preempted

    roomy, none = run(64)
    tight, some = run(12)
    assert none == 0 and some > 0
    assert tight == roomy


def test_deepseek_v4_zeroes_new_blocks_but_not_loaded_ones() -> None:
    """DeepSeek-V4's scheduler asks the runner to zero new blocks; the blocks B loads into are
    left out of that step's zeroing (B still reproduces A)."""
    engine = _engine("deepseek-v4", num_gpu_blocks=480, max_model_len=1024)
    assert engine.scheduler.needs_kv_cache_zeroing
    prompt = _prompt(3 * 256 + 10, seed=6)
    engine.add_request("A", prompt, max_tokens=2)
    engine.run_until_done()
    engine.reset_prefix_cache()
    before = len(engine.zeroed_block_ids)
    engine.add_request("B", prompt, max_tokens=2)
    engine.run_until_done()
    loads = [r for r in _worker(engine).records if r.kind == "load"]
    loaded = {b for r in loads for b in r.gpu_block_ids}
    zeroed_for_b = {b for ids in engine.zeroed_block_ids[before:] for b in ids}
    assert loaded and zeroed_for_b
    assert loaded.isdisjoint(zeroed_for_b)
    assert engine.outputs["B"] == engine.outputs["A"]
    engine.shutdown()
