"""kvforge's vLLM offloading backend against vLLM 0.33's own CPU spec, in one run.

Two measurements, per model shape of ``tests/integrations/vllm_harness.py`` (vLLM's real
``Scheduler``, its connector in both roles, KV caches from vLLM's ``allocate_kv_cache``):

1. **Host bytes.** One prompt runs through vLLM with ``KVForgeConnector``, and through vLLM with
   its own ``CPUOffloadingSpec`` and ``CPUOffloadingManager`` (the harness's
   ``TorchCPUOffloadingSpec``: vLLM's spec and manager, with a torch port of its CUDA-only
   worker, which changes no size). Reported: the host bytes each holds for the prompt, per
   offloaded prompt token. vLLM's: chunks allocated times ``CPUOffloadingSpec.kv_bytes_per_chunk``
   (every key a chunk of the whole, aligned block of every group); kvforge's: pages held times
   each group's unpadded row.
2. **Throughput.** kvforge's worker stores then loads ``--blocks`` random blocks of every group
   (``submit_store`` / ``submit_load``, kvforge's gather/scatter), against ``Tensor.copy_`` of a
   contiguous buffer of the same bytes, medians of ``--repeats``. Where a GPU machine is lent,
   vLLM's own CUDA worker is the fair peer; on CPU it cannot run (it asserts CUDA tensors).

Usage::

    python benchmarks/vllm_offload.py [--models llama,gpt-oss,deepseek-v4] [--blocks 32]
        [--repeats 9] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "integrations"))

#: model -> (tokens per block of its full-attention group, GPU blocks, max_model_len)
SHAPES = {"llama": (16, 64, 256), "gpt-oss": (16, 64, 256), "deepseek-v4": (256, 480, 1024)}


def _engine(model: str, vllm_spec: bool, host_bytes: int, min_blocks: int = 0) -> Any:
    from vllm_harness import build_offload_engine

    _, blocks, max_len = SHAPES[model]
    blocks = max(blocks, min_blocks)
    if vllm_spec:
        return build_offload_engine(
            model,
            num_gpu_blocks=blocks,
            max_model_len=max_len,
            kv_connector="OffloadingConnector",
            extra_config={
                "cpu_bytes_to_use": host_bytes,
                "spec_name": "TorchCPUOffloadingSpec",
                "spec_module_path": "test_vllm_harness",
            },
        )
    return build_offload_engine(
        model,
        num_gpu_blocks=blocks,
        max_model_len=max_len,
        kv_connector="KVForgeConnector",
        kv_connector_module_path="kvforge.integrations.vllm",
        extra_config={"kvforge": {"host_bytes": host_bytes}},
    )


def host_bytes_per_token(model: str, blocks: int = 3) -> dict[str, Any]:
    """Host bytes held after one prompt of ``blocks`` full blocks, both backends."""
    size = SHAPES[model][0]
    prompt = [(i * 7 + 3) % 997 for i in range(size * blocks + 5)]
    out: dict[str, Any] = {"model": model, "prompt_tokens": len(prompt)}
    for side in ("kvforge", "vllm"):
        eng = _engine(model, side == "vllm", 256 << 20)
        eng.add_request("A", prompt, 2)
        eng.run_until_done()
        manager = eng.scheduler_connector.connector_scheduler.manager
        if side == "kvforge":
            worker = eng.worker_connector.connector_worker.worker
            held = manager.held()
            bpc = manager.plan.blocks_per_chunk
            rows = dict(zip(manager.plan.group_ids, worker.block_bytes, strict=True))
            total = sum(held[g] * bpc * rows[g] for g in held)
            out["kvforge_rows"] = [rows[g] for g in manager.plan.group_ids]
        else:
            chunks = manager._num_allocated_chunks - len(manager._free_list)
            per_chunk = eng.worker_connector.connector_worker.spec.kv_bytes_per_chunk
            total = chunks * per_chunk
            out["vllm_chunk_bytes"] = per_chunk
        out[f"{side}_host_bytes"] = total
        out[f"{side}_bytes_per_token"] = total / (size * blocks)
        eng.shutdown()
    out["ratio_vllm_over_kvforge"] = out["vllm_host_bytes"] / out["kvforge_host_bytes"]
    return out


def throughput(model: str, blocks: int, repeats: int) -> dict[str, Any]:
    """Store then load ``blocks`` random blocks of every group, against a contiguous copy."""
    from vllm.v1.kv_offload.base import GPULoadStoreSpec

    from kvforge.integrations.vllm.manager import KVForgeHostSpec

    eng = _engine(model, False, 1 << 30, min_blocks=2 * blocks + 1)
    worker = eng.worker_connector.connector_worker.worker
    n_groups = len(worker.block_bytes)
    num_blocks = eng.kv_cache_config.num_blocks
    rng = np.random.default_rng(0)
    pool = np.arange(1, num_blocks)
    ids = [rng.choice(pool, size=blocks, replace=False) for _ in range(n_groups)]
    gpu = GPULoadStoreSpec(np.concatenate(ids).tolist(), [blocks] * n_groups, [0] * n_groups)
    host = KVForgeHostSpec([np.arange(1, blocks + 1, dtype=np.int32)] * n_groups)
    nbytes = blocks * sum(worker.block_bytes)
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
    dst = torch.empty_like(src)
    times: dict[str, list[float]] = {"store": [], "load": [], "copy": []}
    for r in range(repeats + 1):
        t0 = time.perf_counter()
        worker.submit_store(2 * r, gpu, host)
        t1 = time.perf_counter()
        worker.submit_load(2 * r + 1, host, gpu)
        t2 = time.perf_counter()
        dst.copy_(src)
        t3 = time.perf_counter()
        assert all(res.success for res in worker.get_finished())
        if r:  # the first round warms up
            times["store"].append(t1 - t0)
            times["load"].append(t2 - t1)
            times["copy"].append(t3 - t2)
    eng.shutdown()
    med = {k: statistics.median(v) for k, v in times.items()}
    return {
        "model": model,
        "blocks_per_group": blocks,
        "bytes": nbytes,
        **{f"{k}_gbps": nbytes / v / 1e9 for k, v in med.items()},
        "store_vs_copy": med["copy"] / med["store"],
        "load_vs_copy": med["copy"] / med["load"],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(SHAPES))
    parser.add_argument("--blocks", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--json", default=None, metavar="PATH")
    args = parser.parse_args(argv)
    models = [m for m in args.models.split(",") if m]
    unknown = [m for m in models if m not in SHAPES]
    if unknown:
        parser.error(f"--models: unknown {unknown}; known: {list(SHAPES)}")
    if args.blocks < 1 or args.repeats < 1:
        parser.error(f"--blocks and --repeats must be >= 1, got {args.blocks}, {args.repeats}")
    from rich.console import Console
    from rich.progress import track
    from rich.table import Table

    sizes = [host_bytes_per_token(m) for m in track(models, description="host bytes")]
    speeds = [throughput(m, args.blocks, args.repeats) for m in track(models, description="speed")]
    console = Console()
    t = Table(title="Host bytes for one prompt: vLLM's CPUOffloadingSpec vs kvforge (same run)")
    for col in ("model", "vLLM B/token", "kvforge B/token", "vLLM / kvforge"):
        t.add_column(col, justify="right")
    for s in sizes:
        t.add_row(
            s["model"],
            f"{s['vllm_bytes_per_token']:,.0f}",
            f"{s['kvforge_bytes_per_token']:,.0f}",
            f"{s['ratio_vllm_over_kvforge']:.2f}",
        )
    console.print(t)
    t = Table(title="kvforge worker store/load vs a contiguous copy of the same bytes (CPU)")
    for col in ("model", "MiB", "store GB/s", "load GB/s", "copy GB/s", "store/copy", "load/copy"):
        t.add_column(col, justify="right")
    for s in speeds:
        t.add_row(
            s["model"],
            f"{s['bytes'] / 2**20:.1f}",
            f"{s['store_gbps']:.2f}",
            f"{s['load_gbps']:.2f}",
            f"{s['copy_gbps']:.2f}",
            f"{s['store_vs_copy']:.2f}",
            f"{s['load_vs_copy']:.2f}",
        )
    console.print(t)
    if args.json:
        import vllm

        env = {
            "python": platform.python_version(),
            "machine": platform.machine(),
            "torch": torch.__version__,
            "vllm": vllm.__version__,
        }
        Path(args.json).write_text(
            json.dumps({"environment": env, "host_bytes": sizes, "throughput": speeds}, indent=2)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
