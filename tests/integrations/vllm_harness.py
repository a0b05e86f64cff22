"""Drive vLLM 0.33's real ``Scheduler`` and a WORKER-role KV connector in one process, on CPU.

What it mirrors in vLLM (vLLM 0.33's ``site-packages/vllm``):

- configuration: ``EngineArgs.create_engine_config`` (a ``VllmConfig`` with a
  ``KVTransferConfig``), then ``EngineCore._initialize_kv_caches`` (``v1/engine/core.py``):
  ``resolve_kv_cache_layout``, ``get_global_kv_cache_groups``, ``get_kv_cache_configs`` (the
  block count pinned with ``cache_config.num_gpu_blocks_override``),
  ``generate_scheduler_kv_cache_config``, ``resolve_kv_cache_block_sizes``,
  ``resolve_cache_hit_alignment_tokens``; then ``Scheduler(...)`` as ``EngineCore.__init__``
  builds it (the scheduler creates its connector in SCHEDULER role);
- worker: ``Worker.initialize_from_config`` (``v1/worker/gpu_worker.py``:
  ``ensure_kv_transfer_initialized`` -> ``KVConnectorFactory.create_connector(..., WORKER,
  worker_kv_cache_config)``), then the KV caches as ``init_kv_cache``
  (``v1/worker/gpu/attn_utils.py``, the V2 model runner, vLLM's default on CUDA) and
  ``GPUModelRunner.initialize_kv_cache`` (V1) allocate them: vLLM's own
  ``prepare_kernel_block_sizes`` and ``allocate_kv_cache`` (``v1/worker/utils.py``) called on
  the CPU device, then ``connector.register_kv_caches(kv_caches)`` with those per-layer
  ``[blocks, heads, rows, C]`` manager-block views (``ActiveKVConnector.__init__``);
- one engine step (:meth:`OffloadEngine.step`): ``EngineCore.step`` (``scheduler.schedule()``,
  execute, ``scheduler.update_from_output``) over the V2 runner's ``execute_model`` /
  ``sample_tokens`` (``v1/worker/gpu/model_runner.py``) and ``ActiveKVConnector``
  (``v1/worker/gpu/kv_connector.py``): ``finish_requests`` / ``add_requests`` /
  ``update_requests`` (zeroing ``new_block_ids_to_zero``, ``copy_kv_cache_blocks_inplace`` of
  ``kv_cache_block_copies``), ``pre_forward`` (``handle_preemptions``,
  ``bind_connector_metadata``, ``start_load_kv`` if ``has_sync_kv_loads``), the fake forward,
  ``finish_forward``, ``post_forward`` (``start_load_kv`` otherwise, ``wait_for_save``,
  ``get_transfer_results(finished_req_ids)``, ``get_block_ids_with_load_errors``,
  ``get_kv_connector_stats``, ``get_kv_connector_kv_cache_events``,
  ``build_connector_worker_meta``, ``clear_connector_metadata``) and ``no_forward`` for a step
  without tokens. A request whose KV loads asynchronously waits in ``WAITING_FOR_REMOTE_KVS``
  inside vLLM's scheduler until ``finished_recving`` names it; the harness only reports what
  the worker connector returns.

In-process shortcuts: one ``VllmConfig`` object serves both roles (vLLM pickles it to the
worker process), and one worker (TP 1).

The fake model (:class:`OffloadEngine`) writes, for each scheduled token at position ``p`` and
each layer ``l``, bytes derived from ``(token id, p, l)`` into that token's row of the layer's KV
view (``[blocks, heads, rows, bytes]``; row ``(p % block_size) // tokens_per_state``), through the
request's block table of the layer's group. After a step that completes the request's known
tokens it samples ``hash(bytes of every context row read back through the block tables) % VOCAB``
(a sliding-window group reads only the rows of the last ``sliding_window`` positions), so a
wrong loaded byte changes the generated tokens.

Models (:data:`MODELS`): ``"llama"`` (Llama-3-8B's shape, 2 layers, 2 KV heads), ``"gpt-oss"``
(gpt-oss-20b's shape, 4 layers alternating sliding (window 32) / full, 2 KV heads), and
``"deepseek-v4"`` (DeepSeek-V4-tiny as bundled: vLLM's own DeepSeek-V4 cache modules give the
specs; six groups packed per block). HF configs are kvforge's bundled JSON files, read as data.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

import torch

__all__ = [
    "MODELS",
    "VOCAB",
    "OffloadEngine",
    "ReqState",
    "build_offload_engine",
]

#: vocabulary of the fake model's sampled tokens
VOCAB = 1000

_CONFIGS = Path(__file__).resolve().parents[2] / "kvforge" / "models" / "configs"


@dataclass(frozen=True)
class _ModelDef:
    config: str  # bundled config name
    block_size: int  # --block-size
    hf_overrides: dict[str, Any]


#: harness model name -> bundled config, block size, shrinking overrides (shape kept)
MODELS: dict[str, _ModelDef] = {
    "llama": _ModelDef("llama-3-8b", 16, {"num_hidden_layers": 2, "num_key_value_heads": 2}),
    "gpt-oss": _ModelDef(
        "gpt-oss-20b",
        16,
        {
            "num_hidden_layers": 4,
            "num_key_value_heads": 2,
            "sliding_window": 32,
            "layer_types": ["sliding_attention", "full_attention"] * 2,
        },
    ),
    # vLLM's DeepSeek-V4 kernels support block 256 only; the tiny config is small already
    "deepseek-v4": _ModelDef("deepseek-v4-tiny", 256, {}),
}


def _model_dir(config: str) -> str:
    """A directory holding the bundled ``config.json`` (vLLM's ``ModelConfig`` reads one)."""
    directory = Path(tempfile.gettempdir()) / f"kvforge-vllm-harness-{os.getuid()}" / config
    directory.mkdir(parents=True, exist_ok=True)
    text = (_CONFIGS / f"{config}.json").read_text()
    target = directory / "config.json"
    if not target.exists() or target.read_text() != text:
        target.write_text(text)
    return str(directory)


# --- layer specs (copied from benchmarks/vllm_baseline.py, returning per-layer backends) ------


def _gqa_layer_specs(cfg: Any, gpt_oss: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    """What ``Attention.get_kv_cache_spec`` returns per decoder layer (bf16, FlashAttention
    backend): gpt-oss slides on even layers (``models/gpt_oss.py``), others where
    ``layer_types`` says so, else ``cache_config.sliding_window``."""
    from vllm.model_executor.layers.attention.attention import _largest_kernel_block_within
    from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVQuantMode, SlidingWindowSpec

    hf = cfg.model_config.hf_text_config
    head = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    block_size = cfg.cache_config.block_size
    layer_types = getattr(hf, "layer_types", None)
    common = {
        "num_kv_heads": hf.num_key_value_heads,
        "head_size": head,
        "head_size_v": head,
        "dtype": cfg.model_config.dtype,
        "kv_quant_mode": KVQuantMode.NONE,
    }
    specs: dict[str, Any] = {}
    for i in range(hf.num_hidden_layers):
        if gpt_oss:
            window = hf.sliding_window if i % 2 == 0 else None
        elif layer_types:
            window = hf.sliding_window if layer_types[i] == "sliding_attention" else None
        else:
            window = None
        if window is None:
            window = cfg.cache_config.sliding_window
        if window is None:
            spec = FullAttentionSpec(block_size=block_size, **common)
        else:
            one = SlidingWindowSpec(block_size=1, sliding_window=window, **common)
            per_token = one.real_page_size_bytes
            sw_block = _largest_kernel_block_within(
                FlashAttentionBackend, per_token, per_token * block_size, block_size, one
            )
            spec = SlidingWindowSpec(
                block_size=sw_block, sliding_window=window, page_size_padded=None, **common
            )
        specs[f"model.layers.{i}.self_attn.attn"] = spec
    return specs, dict.fromkeys(specs, FlashAttentionBackend)


def _deepseek_v4_layer_specs(cfg: Any, hf: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """DeepSeek-V4's per-layer specs from vLLM's own cache modules (CUDA FlashMLA path), as
    ``benchmarks/vllm_baseline.py::_deepseek_v4_layer_specs`` builds them (see there)."""
    from vllm.config import set_current_vllm_config
    from vllm.models.deepseek_v4.attention import (
        DeepseekV4IndexerCache,
        _resolve_dsv4_kv_cache_dtype,
    )
    from vllm.models.deepseek_v4.compressor import CompressorStateCache
    from vllm.models.deepseek_v4.nvidia.flashmla import DeepseekV4FlashMLAAttention as Attn
    from vllm.transformers_utils.deepseek_v4_utils import get_compress_ratios
    from vllm.v1.attention.backends.mla.sparse_swa import DeepseekV4SWACache

    kv_cache_dtype, kv_torch_dtype = _resolve_dsv4_kv_cache_dtype(
        Attn.use_fp8_ds_mla_layout, cfg.cache_config.cache_dtype, cfg.cache_config
    )
    ratios = get_compress_ratios(hf)[: hf.num_hidden_layers]
    specs: dict[str, Any] = {}
    backends: dict[str, Any] = {}
    with set_current_vllm_config(cfg):
        for i, ratio in enumerate(ratios):
            r = max(1, int(ratio))
            prefix = f"model.layers.{i}.attn"
            layers: list[Any] = [
                DeepseekV4SWACache(
                    head_dim=hf.head_dim,
                    window_size=hf.sliding_window,
                    dtype=kv_torch_dtype,
                    prefix=f"{prefix}.swa_cache",
                    cache_config=cfg.cache_config,
                    backend_cls=Attn.swa_backend_cls,
                )
            ]
            if r > 1:
                stand_in = SimpleNamespace(
                    compress_ratio=r,
                    kv_cache_dtype=kv_cache_dtype,
                    head_dim=hf.head_dim,
                    kv_cache_torch_dtype=kv_torch_dtype,
                )
                specs[prefix] = Attn.get_kv_cache_spec(stand_in, cfg)
                backends[prefix] = Attn.backend_cls
                layers.append(
                    CompressorStateCache(
                        state_dim=2 * (1 + (r == 4)) * hf.head_dim,
                        dtype=torch.float32,
                        compress_ratio=r,
                        prefix=f"{prefix}.compressor.state_cache",
                    )
                )
            if r == 4:
                index_dim = hf.index_head_dim
                layers.append(
                    DeepseekV4IndexerCache(
                        head_dim=index_dim + index_dim // 128 * 4,
                        dtype=torch.uint8,
                        prefix=f"{prefix}.indexer.k_cache",
                        cache_config=cfg.cache_config,
                        compress_ratio=r,
                    )
                )
                layers.append(
                    CompressorStateCache(
                        state_dim=2 * 2 * index_dim,
                        dtype=torch.float32,
                        compress_ratio=r,
                        prefix=f"{prefix}.indexer.compressor.state_cache",
                    )
                )
            for layer in layers:
                specs[layer.prefix] = layer.get_kv_cache_spec(cfg)
                backends[layer.prefix] = layer.get_attn_backend()
    return specs, backends


# --- engine ---------------------------------------------------------------------------------


@dataclass
class ReqState:
    """Worker-side state of one request (``CachedRequestState`` of the GPU model runner)."""

    req_id: str
    token_ids: list[int]  # prompt + sampled so far
    prompt_len: int
    block_ids: list[list[int]]  # per KV cache group
    num_computed_tokens: int = 0


@dataclass
class _LayerView:
    name: str
    index: int  # global layer index (order of first appearance in the groups)
    group: int
    rows: torch.Tensor  # uint8 [num_blocks, rows_per_block, heads, row_bytes]
    block_size: int
    tokens_per_state: int
    window: int | None  # sliding window in tokens, None = full attention


@dataclass
class OffloadEngine:
    """vLLM's real scheduler (SCHEDULER-role connector inside) + a WORKER-role connector and a
    deterministic fake model over CPU KV caches allocated as vLLM's GPU model runner does.

    Attributes tests read: ``vllm_config``, ``kv_cache_config`` (the worker's),
    ``scheduler_kv_cache_config``, ``scheduler``, ``scheduler_connector``
    (``scheduler.connector``), ``worker_connector``, ``kv_caches`` (what
    ``register_kv_caches`` received), ``outputs`` (req id -> generated token ids),
    ``num_external_computed_tokens`` (req id -> tokens vLLM's scheduler took from the
    connector at admission) and ``prefill_stats`` (req id -> a copy of vLLM's
    ``Request.prefill_stats`` at admission: local / external cached tokens),
    ``finished_recving`` / ``finished_sending`` (req ids reported by the worker connector, in
    order), ``worker_metas`` (every non-None ``build_connector_worker_meta()``),
    ``snapshots`` (req id -> per-group block bytes, taken when the request finished).
    """

    vllm_config: Any
    kv_cache_config: Any
    scheduler_kv_cache_config: Any
    scheduler: Any
    worker_connector: Any
    kv_caches: dict[str, torch.Tensor]
    block_hasher: Callable[[Any], Any] | None
    layers: list[_LayerView]
    outputs: dict[str, list[int]] = field(default_factory=dict)
    num_external_computed_tokens: dict[str, int] = field(default_factory=dict)
    prefill_stats: dict[str, Any] = field(default_factory=dict)
    finished_recving: list[str] = field(default_factory=list)
    finished_sending: list[str] = field(default_factory=list)
    worker_metas: list[Any] = field(default_factory=list)
    snapshots: dict[str, list[list[bytes | None]]] = field(default_factory=dict)
    states: dict[str, ReqState] = field(default_factory=dict)
    zeroed_block_ids: list[list[int]] = field(default_factory=list)
    num_steps: int = 0

    # -- requests ------------------------------------------------------------------------

    @property
    def scheduler_connector(self) -> Any:
        return self.scheduler.connector

    def add_request(self, req_id: str, prompt_token_ids: Sequence[int], max_tokens: int) -> None:
        """``EngineCore.add_request``: a greedy request that ignores EOS."""
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request

        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        request = Request(
            request_id=req_id,
            prompt_token_ids=list(prompt_token_ids),
            sampling_params=params,
            pooling_params=None,
            block_hasher=self.block_hasher,
        )
        self.outputs[req_id] = []
        self.scheduler.add_request(request)

    def reset_prefix_cache(self) -> bool:
        """vLLM's ``Scheduler.reset_prefix_cache()`` (GPU prefix cache only; the offload
        tier keeps its blocks, so a later request's hit must come from it)."""
        return bool(self.scheduler.reset_prefix_cache())

    def has_requests(self) -> bool:
        return bool(self.scheduler.has_requests())

    def run_until_done(self, max_steps: int = 10_000) -> dict[str, list[int]]:
        """Step until the scheduler has no requests (nor pending connector work)."""
        for _ in range(max_steps):
            if not self.has_requests():
                return self.outputs
            self.step()
        raise RuntimeError(f"not done after {max_steps} steps")

    # -- one engine step -----------------------------------------------------------------

    def step(self) -> Any:
        """One ``EngineCore.step`` over the V2 model runner; returns the ``SchedulerOutput``.

        ``GPUModelRunner.execute_model`` (``v1/worker/gpu/model_runner.py``): finish / add /
        update requests (zeroing ``new_block_ids_to_zero``, applying
        ``kv_cache_block_copies``), ``ActiveKVConnector.pre_forward`` (``handle_preemptions``,
        ``bind_connector_metadata``, ``start_load_kv`` now if ``has_sync_kv_loads``), the
        forward, ``finish_forward``, then ``post_forward`` (``start_load_kv`` if not yet,
        ``wait_for_save``, ``get_transfer_results``, ``get_block_ids_with_load_errors``,
        stats, events, ``build_connector_worker_meta``, ``clear_connector_metadata``); a step
        with no tokens is ``ActiveKVConnector.no_forward`` (the same calls, no forward).
        """
        from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, KVConnectorOutput, ModelRunnerOutput

        so = self.scheduler.schedule()
        self.num_steps += 1
        for req_id, req in self.scheduler.requests.items():
            # Scheduler.schedule sets Request.prefill_stats at admission (the first
            # scheduled prefill, an async load included); update_from_output takes it
            stats = req.prefill_stats
            if req_id not in self.prefill_stats and stats is not None and stats.num_prompt_tokens:
                self.prefill_stats[req_id] = copy.copy(stats)
                self.num_external_computed_tokens[req_id] = stats.num_external_cached_tokens
        conn = self.worker_connector
        meta = so.kv_connector_metadata
        assert meta is not None
        self._update_states(so)
        forward = so.total_num_scheduled_tokens > 0
        load_kwargs: dict[str, Any] = {}
        if forward:
            req_ids = list(so.num_scheduled_tokens)
            load_kwargs = {
                "scheduler_output": so,
                "request_state_indices": torch.arange(len(req_ids), dtype=torch.int32),
                "request_ids": req_ids,
                "num_tokens": so.total_num_scheduled_tokens,
            }
        # ActiveKVConnector.pre_forward
        conn.handle_preemptions(meta)
        conn.bind_connector_metadata(meta)
        load_started = False
        if so.has_sync_kv_loads:
            self._start_load_kv(load_kwargs)
            load_started = True
        sampled: dict[str, list[int]] = {}
        if forward:
            sampled = self._forward(so)
        conn.finish_forward()
        # ActiveKVConnector.post_forward
        if not load_started:
            self._start_load_kv(load_kwargs)
        conn.wait_for_save()
        results = conn.get_transfer_results(so.finished_req_ids)
        kv_out = KVConnectorOutput(
            finished_sending=results.finished_sending or None,
            finished_recving=results.finished_recving or None,
            failed_recving=results.failed_recving,
            invalid_block_ids=conn.get_block_ids_with_load_errors(),
            kv_connector_stats=conn.get_kv_connector_stats(),
            kv_cache_events=conn.get_kv_connector_kv_cache_events(),
            kv_connector_worker_meta=conn.build_connector_worker_meta(),
        )
        conn.clear_connector_metadata()
        self.finished_sending += sorted(kv_out.finished_sending or ())
        self.finished_recving += sorted(kv_out.finished_recving or ())
        if kv_out.kv_connector_worker_meta is not None:
            self.worker_metas.append(kv_out.kv_connector_worker_meta)
        if forward:
            req_ids = list(so.num_scheduled_tokens)
            output = ModelRunnerOutput(
                req_ids=req_ids,
                req_id_to_index={r: i for i, r in enumerate(req_ids)},
                sampled_token_ids=[sampled.get(r, []) for r in req_ids],
                kv_connector_output=kv_out,
            )
        else:
            output = ModelRunnerOutput.with_kv_conn_output_only(kv_out)
            if output is EMPTY_MODEL_RUNNER_OUTPUT:
                output = ModelRunnerOutput(req_ids=[], req_id_to_index={})
        engine_outputs = self.scheduler.update_from_output(so, output)
        for eco in engine_outputs.values():
            for out in eco.outputs:
                self.outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
                if out.finish_reason is not None and out.request_id in self.states:
                    self.snapshots[out.request_id] = self._snapshot(out.request_id)
        return so

    def _start_load_kv(self, load_kwargs: dict[str, Any]) -> None:
        """``ActiveKVConnector._start_load_kv``: under a forward context."""
        from vllm.forward_context import get_forward_context, set_forward_context

        with set_forward_context(None, self.vllm_config):
            self.worker_connector.start_load_kv(get_forward_context(), **load_kwargs)

    def _update_states(self, so: Any) -> None:
        """``finish_requests`` / ``add_requests`` / ``update_requests`` of the V2 runner."""
        from vllm.v1.worker.utils import copy_kv_cache_blocks_inplace

        for req_id in so.finished_req_ids | (so.preempted_req_ids or set()):
            self.states.pop(req_id, None)
        for new in so.scheduled_new_reqs:
            # V2 runner: a resumed (preempted) request comes back as a new one, its
            # prefill_token_ids carrying the tokens it had sampled
            prompt = list(new.prompt_token_ids or ())
            tokens = prompt if new.prefill_token_ids is None else list(new.prefill_token_ids)
            self.states[new.req_id] = ReqState(
                req_id=new.req_id,
                token_ids=tokens,
                prompt_len=len(prompt),
                block_ids=[list(ids) for ids in new.block_ids],
                num_computed_tokens=new.num_computed_tokens,
            )
        cached = so.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:  # V1 runner only (V2 sends them as new)
                req = self.scheduler.requests[req_id]
                self.states[req_id] = ReqState(
                    req_id=req_id,
                    token_ids=list(req.all_token_ids),
                    prompt_len=req.num_prompt_tokens,
                    block_ids=[list(ids) for ids in new_ids or ()],
                )
            elif new_ids is not None:
                for group, ids in enumerate(new_ids):
                    self.states[req_id].block_ids[group].extend(ids)
            self.states[req_id].num_computed_tokens = cached.num_computed_tokens[i]
        if so.new_block_ids_to_zero:  # KVBlockZeroer.zero_block_ids
            self.zeroed_block_ids.append(list(so.new_block_ids_to_zero))
            blocks = torch.tensor(so.new_block_ids_to_zero, dtype=torch.long)
            for layer in self.layers:
                layer.rows[blocks] = 0
        if so.kv_cache_block_copies:
            copy_kv_cache_blocks_inplace(
                self.kv_caches.values(), self.kv_cache_config.num_blocks, so.kv_cache_block_copies
            )

    # -- fake model ------------------------------------------------------------------------

    @staticmethod
    def _row_bytes(token: int, pos: int, layer: int, shape: tuple[int, ...]) -> torch.Tensor:
        n = int(np.prod(shape))
        seed = (token * 1_000_003 + pos * 7919 + layer * 104_729) & 0xFFFFFFFF
        rng = np.random.Generator(np.random.PCG64(seed))
        return torch.from_numpy(rng.integers(0, 256, n, dtype=np.uint8).reshape(shape))

    def _slot(self, state: ReqState, layer: _LayerView, pos: int) -> tuple[int, int] | None:
        ids = state.block_ids[layer.group]
        b = pos // layer.block_size
        if b >= len(ids) or ids[b] == 0:  # 0: vLLM's null block (skipped SWA blocks)
            return None
        return ids[b], (pos % layer.block_size) // layer.tokens_per_state

    def _forward(self, so: Any) -> dict[str, list[int]]:
        sampled: dict[str, list[int]] = {}
        for req_id, n in so.num_scheduled_tokens.items():
            state = self.states[req_id]
            start = state.num_computed_tokens
            for pos in range(start, start + n):
                token = state.token_ids[pos]
                for layer in self.layers:
                    slot = self._slot(state, layer, pos)
                    if slot is None:
                        raise AssertionError(
                            f"{req_id}: no block for position {pos} in group {layer.group}"
                        )
                    row = layer.rows[slot[0], slot[1]]
                    row.copy_(self._row_bytes(token, pos, layer.index, tuple(row.shape)))
            end = start + n
            state.num_computed_tokens = end
            if end >= len(state.token_ids):  # not a partial prefill: sample
                token = self._sample(state, end)
                sampled[req_id] = [token]
                state.token_ids.append(token)
        return sampled

    def _context_rows(self, state: ReqState, layer: _LayerView, end: int) -> list[tuple[int, int]]:
        first = 0 if layer.window is None else max(0, end - layer.window)
        slots: list[tuple[int, int]] = []
        for pos in range(first, end):
            slot = self._slot(state, layer, pos)
            if slot is None:
                raise AssertionError(
                    f"{state.req_id}: context position {pos} of group {layer.group} unmapped"
                )
            if not slots or slots[-1] != slot:
                slots.append(slot)
        return slots

    def _sample(self, state: ReqState, end: int) -> int:
        """Hash of every context row (positions ``< end``) read back from the caches."""
        h = hashlib.blake2b(digest_size=8)
        for layer in self.layers:
            slots = self._context_rows(state, layer, end)
            blocks = torch.tensor([s[0] for s in slots], dtype=torch.long)
            rows = torch.tensor([s[1] for s in slots], dtype=torch.long)
            h.update(layer.rows[blocks, rows].contiguous().numpy().tobytes())
        return int.from_bytes(h.digest(), "little") % VOCAB

    # -- inspection ------------------------------------------------------------------------

    def group_layers(self, group: int) -> list[_LayerView]:
        return [layer for layer in self.layers if layer.group == group]

    def block_ids(self, req_id: str, group: int) -> list[int]:
        """The worker's block ids of a running request in ``group`` (0 = null block)."""
        return list(self.states[req_id].block_ids[group])

    def _snapshot(self, req_id: str) -> list[list[bytes | None]]:
        return [
            self._block_bytes(req_id, g) for g in range(len(self.kv_cache_config.kv_cache_groups))
        ]

    def _block_bytes(self, req_id: str, group: int) -> list[bytes | None]:
        state = self.states[req_id]
        layers = self.group_layers(group)
        full = (state.num_computed_tokens) // layers[0].block_size if layers else 0
        window = layers[0].window if layers else None
        first_block = 0
        if window is not None:
            first_block = max(0, state.num_computed_tokens - window) // layers[0].block_size
        out: list[bytes | None] = []
        for b, block_id in enumerate(state.block_ids[group][:full]):
            if b < first_block or block_id == 0:
                out.append(None)
                continue
            out.append(
                b"".join(layer.rows[block_id].contiguous().numpy().tobytes() for layer in layers)
            )
        return out

    def block_bytes(self, req_id: str, group: int = 0) -> list[bytes | None]:
        """Bytes of each FULL block of ``req_id`` in ``group`` (all the group's layers, in
        layer order), ``None`` for a null block or one wholly outside a sliding window.

        A finished request's bytes are the snapshot taken when it finished; a running one's
        are read live.
        """
        if req_id in self.states:
            return self._block_bytes(req_id, group)
        return self.snapshots[req_id][group]

    def shutdown(self) -> None:
        self.worker_connector.shutdown()
        self.scheduler.shutdown()


def build_offload_engine(
    model: str,
    *,
    num_gpu_blocks: int,
    kv_connector: str,
    kv_connector_module_path: str | None = None,
    extra_config: dict[str, Any] | None = None,
    max_model_len: int = 256,
    max_num_batched_tokens: int = 2048,
    max_num_seqs: int = 8,
    kv_load_failure_policy: str = "recompute",
    enable_prefix_caching: bool = True,
    kv_role: str = "kv_both",
    hf_overrides: dict[str, Any] | None = None,
) -> OffloadEngine:
    """Build the engine of ``model`` (a key of :data:`MODELS`) with ``num_gpu_blocks`` blocks.

    ``num_gpu_blocks`` must hold one ``max_model_len`` request (vLLM's own memory check
    raises otherwise). ``max_num_batched_tokens`` below the prompt length gives chunked
    prefill.
    """
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        KVTransferConfig,
        ModelConfig,
        SchedulerConfig,
        VllmConfig,
    )
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.attention.backends.utils import (
        get_supported_kv_cache_layouts,
        resolve_kv_cache_layout,
    )
    from vllm.v1.core.kv_cache_planning import get_global_kv_cache_groups, get_kv_cache_configs
    from vllm.v1.core.kv_cache_utils import (
        generate_scheduler_kv_cache_config,
        get_request_block_hasher,
        init_none_hash,
        resolve_cache_hit_alignment_tokens,
        resolve_kv_cache_block_sizes,
    )
    from vllm.v1.kv_cache_interface import UniformTypeKVCacheSpecs
    from vllm.v1.structured_output import StructuredOutputManager
    from vllm.v1.worker.utils import allocate_kv_cache, prepare_kernel_block_sizes

    if model not in MODELS:
        raise ValueError(f"model must be one of {sorted(MODELS)}, got {model!r}")
    mdef = MODELS[model]
    model_config = ModelConfig(
        model=_model_dir(mdef.config),
        skip_tokenizer_init=True,
        max_model_len=max_model_len,
        dtype="auto",
        hf_overrides={**mdef.hf_overrides, **(hf_overrides or {})},
    )
    layer_types = getattr(model_config.hf_text_config, "layer_types", None)
    sliding_window = None
    if layer_types is None or all(t == "sliding_attention" for t in layer_types):
        # EngineArgs.create_engine_config: the model-level window only if every layer slides
        sliding_window = model_config.get_sliding_window()
    cfg = VllmConfig(
        model_config=model_config,
        cache_config=CacheConfig(
            block_size=mdef.block_size,
            sliding_window=sliding_window,
            enable_prefix_caching=enable_prefix_caching,
            num_gpu_blocks_override=num_gpu_blocks,
        ),
        scheduler_config=SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len,
            is_encoder_decoder=False,
            enable_chunked_prefill=True,
            async_scheduling=False,
        ),
        device_config=DeviceConfig(device="cpu"),
        kv_transfer_config=KVTransferConfig(
            kv_connector=kv_connector,
            kv_connector_module_path=kv_connector_module_path,
            kv_role=kv_role,  # type: ignore[arg-type]
            kv_connector_extra_config=dict(extra_config or {}),
            kv_load_failure_policy=kv_load_failure_policy,  # type: ignore[arg-type]
        ),
    )
    # vLLM enables the hybrid KV cache manager on CUDA; this platform is "unspecified"
    cfg.scheduler_config.disable_hybrid_kv_cache_manager = False

    # EngineCore._initialize_kv_caches
    if model == "deepseek-v4":
        hf = SimpleNamespace(**json.loads((_CONFIGS / f"{mdef.config}.json").read_text()))
        specs, backends = _deepseek_v4_layer_specs(cfg, hf)
    else:
        specs, backends = _gqa_layer_specs(cfg, gpt_oss=model.startswith("gpt-oss"))
    layouts = [layout.name for layout in get_supported_kv_cache_layouts(set(backends.values()))]
    resolve_kv_cache_layout(cfg, [layouts], specs.values())
    groups = get_global_kv_cache_groups(cfg, [specs])
    per_block = sum(s.page_size_bytes for s in specs.values())
    [worker_config] = get_kv_cache_configs(
        cfg, [specs], [per_block * (num_gpu_blocks + 1) * 4], groups
    )
    worker_config.kv_cache_layout = cfg.cache_config.kv_cache_layout
    sched_config = generate_scheduler_kv_cache_config([worker_config])
    cfg.cache_config.num_gpu_blocks = sched_config.num_blocks
    participating = [
        g.kv_cache_spec.block_size
        for g in sched_config.kv_cache_groups
        if g.kv_cache_spec.prefix_cacheable
    ]
    cfg.cache_config.block_size = min(
        participating or [g.kv_cache_spec.block_size for g in sched_config.kv_cache_groups]
    )
    scheduler_block_size, hash_block_size = resolve_kv_cache_block_sizes(sched_config, cfg)
    alignment = resolve_cache_hit_alignment_tokens(
        sched_config, cfg, scheduler_block_size, hash_block_size
    )
    for kvc in (worker_config, sched_config):
        kvc.hash_block_size = hash_block_size
        kvc.cache_hit_alignment_tokens = alignment
    cfg.cache_config.hash_block_size = hash_block_size
    cfg.cache_config.cache_hit_alignment_tokens = alignment

    # Worker.initialize_from_config: the WORKER-role connector first, then the caches
    worker_connector = KVConnectorFactory.create_connector(
        config=cfg, role=KVConnectorRole.WORKER, kv_cache_config=worker_config
    )
    attn_groups = [
        [
            SimpleNamespace(
                backend=backends[name], kv_cache_spec=_layer_spec(g, name, UniformTypeKVCacheSpecs)
            )
            for name in g.layer_names[:1]
        ]
        for g in worker_config.kv_cache_groups
    ]
    kernel_block_sizes = prepare_kernel_block_sizes(worker_config, attn_groups)  # type: ignore[arg-type]
    if kernel_block_sizes != [g.kv_cache_spec.block_size for g in worker_config.kv_cache_groups]:
        raise NotImplementedError(
            f"kernel block sizes {kernel_block_sizes} differ from the manager's; the fake "
            "model addresses manager blocks only"
        )
    kv_caches = allocate_kv_cache(
        worker_config,
        torch.device("cpu"),
        cfg.cache_config.get_resolved_kv_cache_layout(),
        kernel_block_sizes,
    )
    worker_connector.register_kv_caches(kv_caches)

    layers: list[_LayerView] = []
    for gid, g in enumerate(worker_config.kv_cache_groups):
        for name in g.layer_names:
            spec = _layer_spec(g, name, UniformTypeKVCacheSpecs)
            kv = kv_caches[name]
            u8 = kv.view(torch.uint8)  # [blocks, heads, rows, row bytes]
            if u8.dim() != 4:
                raise NotImplementedError(f"{name}: KV view of shape {tuple(kv.shape)}")
            layers.append(
                _LayerView(
                    name=name,
                    index=len(layers),
                    group=gid,
                    rows=u8.transpose(1, 2),
                    block_size=spec.block_size,
                    tokens_per_state=getattr(spec, "tokens_per_state", 1) or 1,
                    window=getattr(spec, "sliding_window", None),
                )
            )

    # EngineCore.__init__: the block hasher and the scheduler (SCHEDULER-role connector)
    block_hasher = None
    if cfg.cache_config.enable_prefix_caching:
        hash_fn = get_hash_fn_by_name(cfg.cache_config.prefix_caching_hash_algo)
        init_none_hash(hash_fn)
        block_hasher = get_request_block_hasher(
            hash_block_size, hash_fn, cfg.num_hash_lookahead_tokens
        )
    scheduler = cfg.scheduler_config.get_scheduler_cls()(
        vllm_config=cfg,
        kv_cache_config=sched_config,
        structured_output_manager=StructuredOutputManager(cfg),
        include_finished_set=False,
        log_stats=True,
        block_size=scheduler_block_size,
        hash_block_size=hash_block_size,
    )
    if scheduler.connector is None:
        raise RuntimeError("vLLM's scheduler built no KV connector")
    return OffloadEngine(
        vllm_config=cfg,
        kv_cache_config=worker_config,
        scheduler_kv_cache_config=sched_config,
        scheduler=scheduler,
        worker_connector=worker_connector,
        kv_caches=kv_caches,
        block_hasher=block_hasher,
        layers=layers,
    )


def _layer_spec(group: Any, name: str, uniform: type) -> Any:
    spec = group.kv_cache_spec
    return spec.kv_cache_specs[name] if isinstance(spec, uniform) else spec
