#!/usr/bin/env python
"""Prefix hits under memory pressure: vLLM 0.33's real ``KVCacheManager`` against kvforge, at
identical bytes, on the same seeded multi-turn conversations.

Both sides are driven by one engine loop (:class:`FcfsEngine`), a port of the first-come,
first-served policy of vLLM's ``Scheduler.schedule`` / ``update_from_output`` (v1, synchronous):

- per step, the running requests first, in admission order: a prefill chunk (at most the
  step's token budget, ``max_num_batched_tokens``, and the per-request chunk cap,
  ``long_prefill_token_threshold``, when more than one request is eligible) or one decode
  token; a request that cannot grow preempts the newest running request (itself last) and
  recomputes it later;
- then, in a step without preemptions, the waiting requests in order while rows
  (``max_num_seqs``) and budget last: look the prompt up, allocate the hit plus the first
  chunk, and stop at the first request that does not fit;
- after the step, every request whose known tokens are all computed samples one token (the
  conversation's next token); a request that reached its output length finishes and frees.

A side (:class:`CacheSide`) is what the loop calls: :class:`VllmManagerSide` (vLLM's
``KVCacheManager``, called as ``Scheduler`` calls it: ``new_step_starts``,
``get_computed_blocks``, ``allocate_slots`` with ``full_sequence_must_fit`` for a waiting
request and per chunk / decode token for a running one, ``free``, the request counters of
``_update_after_schedule`` and ``update_from_output``; hashing by vLLM's own request block
hasher) and :class:`KvforgeSide` (``BlockManager.lookup`` / ``schedule`` / ``end_step`` /
``finish``, one ``schedule`` call per request in the loop's order, each ended at once, as
vLLM caches a block when it allocates it).

The workload is ``prefix_sim``'s (:class:`~prefix_sim.PrefixWorkload`: conversations sharing a
system prompt, seeded user messages, outputs and think times; at most ``concurrency``
conversations open), with ``max_model_len`` 8,192.

Memory sizes: vLLM with dense retention on a pool that holds every block of every turn gives
the working set ``W`` (blocks holding a cached block hash when the run ends, times vLLM's
bytes per block); each size is a fraction of ``W`` (1/4, 1/2, 1) or ``4 W`` ("unbounded").
For a size ``M``, vLLM's engine start (``vllm_baseline.build_vllm_cache_setup``, i.e.
``get_kv_cache_configs`` with ``M`` as the profiled memory) gives ``num_blocks = M //
bytes_per_block``; its backing allocation, ``num_blocks * bytes_per_block``, is then kvforge's
``memory_budget`` (``plan_memory`` at that budget, kvforge's default sizing, pooled as
``CacheController.initialize_kv_cache`` pools it). Per model and size:

- ``vllm_default``: hit tokens with vLLM's default retention
  (``CacheConfig(prefix_cache_retention_interval=0)``: sliding-window blocks kept only where a
  later prompt can end);
- ``vllm_dense``: with ``prefix_cache_retention_interval=None`` (every block kept);
- ``kvforge``: kvforge's default (whatever ``CacheController`` and ``plan_memory`` default to
  when this runs; ``--kvforge-option NAME=VALUE`` passes options where their signatures take
  them);
- ``kvforge / vLLM`` for both vLLM figures.

A turn's hit is counted once, when it is first admitted (re-admissions after a preemption are
counted in ``recomputed_tokens``).

Usage::

    PYTHONPATH=. ~/.venv-vllm/bin/python benchmarks/prefix_vs_vllm.py
        [--models a,b] [--seed 0] [--quick] [--json PATH] [--no-vllm] [--no-progress]
        [--no-scheduler-check] [--kvforge-option NAME=VALUE ...]

Without vLLM (the project's ``.venv``) the script says so and exits 2, unless ``--no-vllm``:
then only kvforge runs, at sizes relative to an estimate of the working set from kvforge's
own pages (:func:`estimated_working_set`).
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import inspect
import json
import os
import platform
import sys
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Any, Protocol

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from prefix_sim import Conversation, PrefixWorkload, make_conversations
from vllm_baseline import (
    RETENTION_DEFAULT,
    RETENTION_DENSE,
    VLLM_VERSION,
    VS_MODELS,
    vllm_available,
)

from kvforge.cli.formatting import console, make_table

__all__ = [
    "DEFAULT_SIZES",
    "MODELS",
    "CacheSide",
    "FcfsEngine",
    "KvforgeSide",
    "PrefixRow",
    "SideResult",
    "SimRequest",
    "VllmManagerSide",
    "estimated_working_set",
    "kvforge_backends",
    "kvforge_manager",
    "kvforge_settings",
    "main",
    "parse_kvforge_options",
    "prefix_workload",
    "run_conversations",
    "run_conversations_on_scheduler",
    "run_prefix_vs_vllm",
    "short_reason",
]

#: models (kvforge bundled config names), in table order
MODELS: tuple[str, ...] = VS_MODELS
#: memory sizes as multiples of the working set; the last one is "unbounded"
DEFAULT_SIZES: tuple[Fraction, ...] = (Fraction(1, 4), Fraction(1, 2), Fraction(1), Fraction(4))
UNBOUNDED = Fraction(4)
MAX_MODEL_LEN = 8192
#: GQA models are compared in bf16 on both sides (vLLM's "auto" for every one of them)
_GQA_DTYPE = "bfloat16"


# --- kvforge, through its public API --------------------------------------------------------


def kvforge_backends(model: str) -> Any:
    """kvforge's backends of ``model``'s bundled config, bf16 for the GQA models (DeepSeek-V4
    keeps its own dtypes: fp8 pages, fp32 compressor state, as vLLM's)."""
    from kvforge import from_hf_config

    if model.startswith("deepseek-v4"):
        return from_hf_config(model)
    return from_hf_config(model, dtype=_GQA_DTYPE)


def parse_kvforge_options(items: Sequence[str]) -> dict[str, Any]:
    """``NAME=VALUE`` strings into options; values are Python literals where they parse
    (``True``, ``3``, ``'dense'``), else strings."""
    out: dict[str, Any] = {}
    for item in items:
        name, sep, text = item.partition("=")
        if not sep or not name.isidentifier():
            raise ValueError(f"--kvforge-option takes NAME=VALUE, got {item!r}")
        try:
            out[name] = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            out[name] = text
    return out


def _accepts(fn: Callable[..., Any], name: str) -> bool:
    params = inspect.signature(fn).parameters
    return name in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


def _defaults(fn: Callable[..., Any]) -> dict[str, Any]:
    return {
        n: p.default
        for n, p in inspect.signature(fn).parameters.items()
        if p.default is not inspect.Parameter.empty and n != "self"
    }


def kvforge_settings(options: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """What the kvforge side runs with: ``CacheController``'s and ``plan_memory``'s defaults
    (JSON-friendly), overridden by ``options``."""
    from kvforge import CacheController, plan_memory

    def plain(v: Any) -> Any:
        return v if isinstance(v, (bool, int, float, str, type(None))) else repr(v)

    settings = {
        "controller": {k: plain(v) for k, v in _defaults(CacheController.__init__).items()},
        "plan_memory": {k: plain(v) for k, v in _defaults(plan_memory).items()},
        "options": {k: plain(v) for k, v in (options or {}).items()},
    }
    return settings


def kvforge_manager(
    model: str,
    memory_budget: int,
    *,
    max_num_seqs: int,
    max_model_len: int,
    max_num_batched_tokens: int,
    enable_prefix_caching: bool,
    options: Mapping[str, Any] | None = None,
) -> tuple[Any, dict[str, Any]]:
    """kvforge's scheduler side at ``memory_budget`` bytes, sized as
    ``CacheController(backends, enable_prefix_caching=...).initialize_kv_cache(memory_budget=...,
    max_num_seqs=..., max_model_len=...)`` sizes it, without allocating the device caches.

    The steps are the controller's, through public functions: ``plan_memory(layout, budget,
    max_num_seqs, max_model_len, max_num_batched_tokens, **plan options)`` (plan options:
    ``enable_prefix_caching`` where ``plan_memory`` takes it, and ``options`` it takes), a pool
    of 2 for a group the plan leaves out, ``shared_pool_blocks`` when the controller's
    ``share_pools`` (its default, or ``options``) is on, then ``BlockManager(layout, blocks,
    max_num_seqs, max_model_len, enable_prefix_caching, share_pools=..., **options it takes)``.
    ``tests/benchmarks/test_prefix_vs_vllm.py`` checks the pools against a real controller's.

    Returns the manager and a record: the plan's ``describe()`` lines, its bytes, the pools.
    """
    from kvforge import BlockManager, CacheController, CacheLayout, plan_memory
    from kvforge.core.flow import plan_with_arena
    from kvforge.core.memory_plan import shared_pool_blocks

    options = dict(options or {})
    layout = CacheLayout(kvforge_backends(model))
    controller_defaults = _defaults(CacheController.__init__)
    share = bool(options.pop("share_pools", controller_defaults.get("share_pools", False)))
    plan_opts = {}
    if _accepts(plan_memory, "enable_prefix_caching"):
        plan_opts["enable_prefix_caching"] = enable_prefix_caching
    manager_opts = {}
    for name, value in options.items():
        taken = False
        if _accepts(plan_memory, name):
            plan_opts[name] = value
            taken = True
        if _accepts(BlockManager.__init__, name):
            manager_opts[name] = value
            taken = True
        if not taken:
            raise ValueError(
                f"kvforge option {name!r} is taken by neither plan_memory nor BlockManager"
            )
    plan = plan_memory(
        layout, memory_budget, max_num_seqs, max_model_len, max_num_batched_tokens, **plan_opts
    )
    if share:  # groups whose pages differ draw on one slab arena, as the controller plans
        plan = plan_with_arena(plan, layout)
    blocks = dict(plan.num_blocks)
    for g in layout.groups:
        blocks.setdefault(g.name, 2)
    if share:
        blocks = shared_pool_blocks(layout, blocks)
    manager = BlockManager(
        layout,
        blocks,
        max_num_seqs,
        max_model_len,
        enable_prefix_caching,
        share_pools=share,
        arena=plan.arena,
        **manager_opts,
    )
    pools: dict[str, int] = {}
    in_arena = set(plan.arena.groups) if plan.arena is not None else set()
    for members in layout.pools(share, blocks):
        if members[0] not in in_arena:
            pools["+".join(members)] = blocks[members[0]]
    pool_bytes = sum(
        n * int(layout.bytes_per_block(name.split("+")[0])) for name, n in pools.items()
    )
    if plan.arena is not None:
        pools["arena " + "+".join(plan.arena.groups)] = plan.arena.num_slabs
        pool_bytes += plan.arena.total_bytes
    record = {
        "plan": list(plan.describe()),
        "plan_bytes": int(plan.total_bytes),
        "pool_bytes": int(pool_bytes),
        "pools": pools,
        "share_pools": share,
        "plan_options": {k: repr(v) for k, v in plan_opts.items()},
    }
    return manager, record


# --- the engine loop --------------------------------------------------------------------------


@dataclass(eq=False)
class SimRequest:
    """One request of the loop: ``tokens`` is its whole stream (prompt, then the tokens it
    will sample); ``num_tokens`` of them are known, ``computed`` have KV."""

    rid: str
    tokens: np.ndarray
    prompt_len: int
    max_output: int
    num_tokens: int = 0
    computed: int = 0
    hit: int | None = None  # prefix hit at the first admission
    admissions: int = 0
    preemptions: int = 0
    recomputed: int = 0  # tokens prefilled again after preemptions (hits excluded)
    tag: Any = None

    def __post_init__(self) -> None:
        if self.num_tokens == 0:
            self.num_tokens = self.prompt_len
        if len(self.tokens) < self.prompt_len + self.max_output - 1:
            raise ValueError(f"{self.rid}: the stream is shorter than prompt + output - 1")


class CacheSide(Protocol):
    """What :class:`FcfsEngine` calls; every method follows one ``Scheduler`` call site."""

    name: str

    def begin_step(self) -> None: ...

    def lookup(self, r: SimRequest) -> tuple[int, Any]: ...

    def admit(self, r: SimRequest, n: int, hit: int, handle: Any, has_scheduled: bool) -> bool: ...

    def grow(self, r: SimRequest, n: int) -> bool: ...

    def preempt(self, r: SimRequest) -> None: ...

    def end_step(self, scheduled: Sequence[tuple[SimRequest, int]]) -> None: ...

    def settle(self, r: SimRequest, n: int, sampled: bool) -> None: ...

    def finish(self, r: SimRequest) -> None: ...


@dataclass
class StepResult:
    scheduled: list[tuple[SimRequest, int]]
    finished: list[SimRequest]
    preempted: list[SimRequest]


class FcfsEngine:
    """vLLM's FCFS scheduling loop (v1 ``Scheduler``, synchronous, no speculative decoding,
    no connector, no encoder) over a :class:`CacheSide`. See the module docstring."""

    def __init__(
        self,
        side: CacheSide,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        long_prefill_token_threshold: int = 0,
    ) -> None:
        self.side = side
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.long_prefill_token_threshold = long_prefill_token_threshold
        self.waiting: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []
        self.steps = 0
        self.preemptions = 0
        #: called after each step's scheduling, before its tokens land: (running, scheduled)
        self.on_scheduled: Callable[[list[SimRequest], list[tuple[SimRequest, int]]], None] | None
        self.on_scheduled = None

    def add(self, r: SimRequest) -> None:
        if r.prompt_len + r.max_output > self.max_model_len:
            raise ValueError(f"{r.rid}: prompt + output exceed max_model_len")
        self.waiting.append(r)

    def has_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def step(self) -> StepResult:
        side, running, waiting = self.side, self.running, self.waiting
        side.begin_step()
        budget = self.max_num_batched_tokens
        threshold = self.long_prefill_token_threshold if len(running) + len(waiting) > 1 else 0
        scheduled: list[tuple[SimRequest, int]] = []
        preempted: list[SimRequest] = []
        i = 0
        while i < len(running) and budget > 0:
            r = running[i]
            n = r.num_tokens - r.computed
            if 0 < threshold < n:
                n = threshold
            n = min(n, budget, self.max_model_len - r.computed - 1)
            if n <= 0:
                i += 1
                continue
            ok = False
            while True:
                if side.grow(r, n):
                    ok = True
                    break
                victim = running.pop()
                side.preempt(victim)
                victim.computed = 0
                victim.preemptions += 1
                waiting.appendleft(victim)
                preempted.append(victim)
                if victim is r:
                    break
            if not ok:
                break
            scheduled.append((r, n))
            budget -= n
            i += 1
        if not preempted:
            while budget > 0 and waiting and len(running) < self.max_num_seqs:
                r = waiting[0]
                hit, handle = side.lookup(r)
                n = r.num_tokens - hit
                if 0 < threshold < n:
                    n = threshold
                n = min(n, budget)
                if n <= 0:
                    raise AssertionError(f"{r.rid}: a hit of {hit} leaves nothing to compute")
                if not side.admit(r, n, hit, handle, bool(running)):
                    break
                waiting.popleft()
                running.append(r)
                r.computed = hit
                if r.admissions:
                    r.recomputed += r.num_tokens - hit
                elif r.hit is None:
                    r.hit = hit
                r.admissions += 1
                scheduled.append((r, n))
                budget -= n
        side.end_step(scheduled)
        self.preemptions += len(preempted)
        if self.on_scheduled is not None:
            self.on_scheduled(running, scheduled)
        # update_from_output: tokens land; a request caught up samples one token
        finished: list[SimRequest] = []
        for r, n in scheduled:
            r.computed += n
            sampled = r.computed >= r.num_tokens
            if sampled:
                r.num_tokens += 1
            side.settle(r, n, sampled)
            if sampled and (
                r.num_tokens - r.prompt_len >= r.max_output or r.num_tokens >= self.max_model_len
            ):
                finished.append(r)
        for r in finished:
            running.remove(r)
            side.finish(r)
        self.steps += 1
        return StepResult(scheduled, finished, preempted)


# --- the two sides ----------------------------------------------------------------------------


class VllmManagerSide:
    """vLLM's ``KVCacheManager`` as ``Scheduler`` drives it (see the module docstring).

    ``setup`` is a ``vllm_baseline.VllmCacheSetup``; the manager is built as
    ``Scheduler.__init__`` builds it and requests as ``EngineCore`` builds them (with its
    request block hasher when prefix caching is on; ``ignore_eos``, ``max_tokens`` = the
    request's output length).
    """

    def __init__(self, setup: Any, name: str = "vLLM") -> None:
        import vllm_baseline as vb
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request, RequestStatus

        self.name = name
        self.setup = setup
        cfg = setup.vllm_config
        self.manager = vb.build_vllm_kv_cache_manager(setup)
        self.hasher = vb.vllm_block_hasher(setup)
        self.caching = bool(cfg.cache_config.enable_prefix_caching)
        self.full_sequence_must_fit = bool(cfg.scheduler_config.scheduler_reserve_full_isl)
        self._Request, self._SamplingParams, self._status = Request, SamplingParams, RequestStatus
        self._requests: dict[str, Any] = {}

    def request(self, r: SimRequest) -> Any:
        req = self._requests.get(r.rid)
        if req is None:
            req = self._Request(
                request_id=r.rid,
                prompt_token_ids=r.tokens[: r.prompt_len].tolist(),
                sampling_params=self._SamplingParams(max_tokens=r.max_output, ignore_eos=True),
                pooling_params=None,
                block_hasher=self.hasher,
            )
            self._requests[r.rid] = req
        return req

    def begin_step(self) -> None:
        self.manager.new_step_starts()

    def lookup(self, r: SimRequest) -> tuple[int, Any]:
        req = self.request(r)
        blocks, hit, boundary = self.manager.get_computed_blocks(req)
        req.shared_prefix_boundary = boundary
        return hit, blocks

    def admit(self, r: SimRequest, n: int, hit: int, handle: Any, has_scheduled: bool) -> bool:
        req = self.request(r)
        new_blocks = self.manager.allocate_slots(
            req,
            n,
            num_new_computed_tokens=hit,
            new_computed_blocks=handle,
            num_lookahead_tokens=0,
            num_external_computed_tokens=0,
            delay_cache_blocks=False,
            num_encoder_tokens=0,
            full_sequence_must_fit=self.full_sequence_must_fit,
            reserved_blocks=0,
            has_scheduled_reqs=has_scheduled,
        )
        if new_blocks is None:
            return False
        req.status = self._status.RUNNING
        req.num_computed_tokens = hit
        return True

    def grow(self, r: SimRequest, n: int) -> bool:
        return self.manager.allocate_slots(self.request(r), n, num_lookahead_tokens=0) is not None

    def preempt(self, r: SimRequest) -> None:  # Scheduler._preempt_request
        req = self.request(r)
        self.manager.free(req)
        req.status = self._status.PREEMPTED
        req.num_computed_tokens = 0
        req.num_stale_output_tokens = req.num_in_flight_tokens
        req.num_output_placeholders = 0
        req.num_preemptions += 1

    def end_step(self, scheduled: Sequence[tuple[SimRequest, int]]) -> None:
        self.manager.take_new_block_ids()  # Scheduler._get_new_block_ids_to_zero
        for r, n in scheduled:  # Scheduler._update_after_schedule
            req = self.request(r)
            req.num_computed_tokens += n
            req.num_in_flight_tokens += n
            req.is_prefill_chunk = req.num_computed_tokens < (
                req.num_tokens + req.num_output_placeholders
            )

    def settle(self, r: SimRequest, n: int, sampled: bool) -> None:
        req = self.request(r)
        req.num_in_flight_tokens -= n
        if req.num_stale_output_tokens > 0:
            req.num_stale_output_tokens -= n
        if sampled:
            req.append_output_token_ids(int(r.tokens[r.num_tokens - 1]))

    def finish(self, r: SimRequest) -> None:  # check_stop, then Scheduler._free_request
        req = self._requests.pop(r.rid)
        req.status = self._status.FINISHED_LENGTH_CAPPED
        self.manager.free(req)

    def cached_blocks(self) -> int:
        """Blocks of the pool holding a block hash (cached, in use or evictable)."""
        return sum(1 for b in self.manager.block_pool.blocks if b.block_hash is not None)


class KvforgeSide:
    """kvforge's ``BlockManager``, one ``schedule`` call per request in the loop's order,
    each ended at once (a synchronous engine; vLLM caches a block when it allocates it, so a
    later request of the same step may share it, and so may kvforge's). A request is a new
    kvforge request at each admission (``rid@k``), finished when it is preempted.

    ``gate_chunk``: admit a waiting request only if its whole prompt fits now, as vLLM's
    ``scheduler_reserve_full_isl`` gate does, asked of ``BlockManager.prompt_fits`` (prefilled
    in chunks of ``gate_chunk`` tokens). A manager without that check (an older kvforge) is
    probed instead, with prefix caching off only: a throw-away request is scheduled over the
    prompt in chunks (each step ended) and finished; the request is admitted only if no chunk
    was refused. Without it (None), a request is admitted when its first chunk fits.
    """

    def __init__(self, manager: Any, name: str = "kvforge", gate_chunk: int | None = None) -> None:
        from kvforge import PrefixQuery

        self.name = name
        self.manager = manager
        self.caching = bool(manager.prefix_caching)
        self.query = hasattr(manager, "prompt_fits")  # kvforge's own admission check
        if gate_chunk is not None and self.caching and not self.query:
            raise ValueError("the whole-prompt gate probes the pools: prefix caching must be off")
        self.gate_chunk = gate_chunk
        self._Query = PrefixQuery
        self._ids: dict[str, str] = {}
        self._probes = 0

    def _whole_prompt_fits(self, r: SimRequest, hit: int, match: Any = None) -> bool:
        assert self.gate_chunk is not None
        if self.query:  # BlockManager.prompt_fits: a pure check, nothing taken
            return bool(self.manager.prompt_fits(r.num_tokens, self.gate_chunk, match))
        self._probes += 1
        pid = f"{r.rid}@probe{self._probes}"
        start = hit
        fits = True
        while start < r.num_tokens:
            n = min(self.gate_chunk, r.num_tokens - start)
            step = self.manager.schedule([pid], [n])
            self.manager.end_step(step)
            if step.refused:
                fits = False
                break
            start += n
        if start > hit:
            self.manager.finish([pid])
        return fits

    def begin_step(self) -> None:
        pass

    def lookup(self, r: SimRequest) -> tuple[int, Any]:
        if not self.caching:
            return 0, None
        match = self.manager.lookup([self._Query(r.tokens[: r.num_tokens])])[0]
        return int(match.num_tokens), match

    def _run(self, kid: str, r: SimRequest, start: int, n: int, match: Any) -> bool:
        tokens = [r.tokens[start : start + n]] if self.caching else None
        matches = [match] if match is not None else None
        step = self.manager.schedule([kid], [n], new_token_ids=tokens, prefix_matches=matches)
        self.manager.end_step(step)
        return not step.refused

    def admit(self, r: SimRequest, n: int, hit: int, handle: Any, has_scheduled: bool) -> bool:
        if self.gate_chunk is not None and not self._whole_prompt_fits(r, hit, handle):
            return False
        kid = f"{r.rid}@{r.admissions}"
        if not self._run(kid, r, hit, n, handle):
            return False
        self._ids[r.rid] = kid
        return True

    def grow(self, r: SimRequest, n: int) -> bool:
        return self._run(self._ids[r.rid], r, r.computed, n, None)

    def preempt(self, r: SimRequest) -> None:
        self.manager.finish([self._ids.pop(r.rid)])

    def end_step(self, scheduled: Sequence[tuple[SimRequest, int]]) -> None:
        pass

    def settle(self, r: SimRequest, n: int, sampled: bool) -> None:
        pass

    def finish(self, r: SimRequest) -> None:
        self.manager.finish([self._ids.pop(r.rid)])


# --- conversations through the loop -----------------------------------------------------------


@dataclass
class SideResult:
    """One side's run over the conversations (token counts are exact)."""

    side: str
    prompt_tokens: int = 0
    hit_tokens: int = 0
    turns: int = 0
    steps: int = 0
    preemptions: int = 0
    recomputed_tokens: int = 0
    max_running: int = 0
    seconds: float = 0.0

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def prefix_workload(seed: int = 0, quick: bool = False) -> PrefixWorkload:
    """The conversations: ``prefix_sim``'s default workload at ``max_model_len`` 8,192 (64
    conversations, 32 open, 16 running, a 700-token system prompt, 4,096-token steps, 2,048-token
    chunks); ``quick``: 16 conversations, 6 open, 4 running, shorter messages, 1,024 tokens."""
    if quick:
        return PrefixWorkload(
            seed=seed,
            num_conversations=16,
            concurrency=6,
            max_num_seqs=4,
            system_prompt_len=200,
            min_turns=2,
            max_turns=4,
            user_median=30.0,
            output_median=40.0,
            output_max=128,
            user_max=200,
            think_min=1,
            think_max=8,
            chunk_size=256,
            max_num_batched_tokens=512,
            max_model_len=1024,
        )
    return PrefixWorkload(seed=seed, max_model_len=MAX_MODEL_LEN)


def run_conversations(
    wl: PrefixWorkload,
    convs: Sequence[Conversation],
    side: CacheSide,
    tick: Callable[[], None] | None = None,
) -> SideResult:
    """Serve every turn of ``convs`` through :class:`FcfsEngine` over ``side``.

    At most ``wl.concurrency`` conversations are open; turn ``k`` of a conversation arrives
    ``think[k]`` steps after turn ``k - 1`` finished (``think[0]`` after it opens), and a
    conversation that ends opens the next one. Arrivals join the waiting queue in (step,
    conversation) order. ``tick`` is called once per 256 steps (progress).
    """
    engine = FcfsEngine(
        side, wl.max_num_seqs, wl.max_num_batched_tokens, wl.max_model_len, wl.chunk_size
    )
    result = SideResult(side=side.name)
    pending: list[tuple[int, int, int]] = []  # (due step, conversation, turn)
    next_conv = min(wl.concurrency, len(convs))
    for c in range(next_conv):
        pending.append((convs[c].think[0], c, 0))
    step = 0
    t0 = time.perf_counter()
    done: list[SimRequest] = []
    while pending or engine.has_requests():
        pending.sort()
        while pending and pending[0][0] <= step:
            _, c, k = pending.pop(0)
            conv = convs[c]
            engine.add(
                SimRequest(
                    rid=f"c{c}t{k}",
                    tokens=conv.tokens,
                    prompt_len=conv.prompt_lens[k],
                    max_output=conv.output_lens[k],
                    tag=(c, k),
                )
            )
        if not engine.has_requests():
            step = pending[0][0]
            continue
        out = engine.step()
        result.max_running = max(result.max_running, len(engine.running))
        for r in out.finished:
            done.append(r)
            c, k = r.tag
            conv = convs[c]
            if k + 1 < len(conv.prompt_lens):
                pending.append((step + 1 + conv.think[k + 1], c, k + 1))
            elif next_conv < len(convs):
                pending.append((step + 1 + convs[next_conv].think[0], next_conv, 0))
                next_conv += 1
        step += 1
        if tick is not None and step % 256 == 0:
            tick()
    result.seconds = time.perf_counter() - t0
    result.steps = engine.steps
    result.preemptions = engine.preemptions
    for r in done:
        result.turns += 1
        result.prompt_tokens += r.prompt_len
        result.hit_tokens += int(r.hit or 0)
        result.recomputed_tokens += r.recomputed
    expected = sum(len(c.prompt_lens) for c in convs)
    if result.turns != expected:
        raise AssertionError(f"{side.name}: {result.turns} turns finished of {expected}")
    return result


def run_conversations_on_scheduler(
    wl: PrefixWorkload,
    convs: Sequence[Conversation],
    setup: Any,
    name: str = "vLLM Scheduler",
    tick: Callable[[], None] | None = None,
) -> SideResult:
    """The same conversations through vLLM's real ``Scheduler`` (the check of
    :class:`VllmManagerSide`): requests are added as turns arrive (``Scheduler.add_request``,
    with ``EngineCore``'s block hasher), each step is ``schedule()`` then
    ``update_from_output`` of a fake output sampling the conversation's next token for every
    request that is not a partial prefill; a turn's hit is ``NewRequestData.num_computed_tokens``
    when it is first scheduled. ``setup`` must carry ``long_prefill_token_threshold =
    wl.chunk_size`` (the loop's chunk cap). Steps and arrivals are counted as
    :func:`run_conversations` counts them, so both runs see the same request stream."""
    import vllm_baseline as vb
    from vllm.sampling_params import SamplingParams
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import Request

    cfg = setup.vllm_config
    if cfg.scheduler_config.long_prefill_token_threshold != wl.chunk_size:
        raise ValueError("the setup's long_prefill_token_threshold must be wl.chunk_size")
    sched = vb.build_vllm_scheduler(setup)
    hasher = vb.vllm_block_hasher(setup)
    result = SideResult(side=name)
    pending: list[tuple[int, int, int]] = []
    next_conv = min(wl.concurrency, len(convs))
    for c in range(next_conv):
        pending.append((convs[c].think[0], c, 0))
    live: dict[str, tuple[Any, int, int]] = {}  # rid -> (request, conversation, turn)
    hits: dict[str, int] = {}
    preemptions = 0
    step = 0
    t0 = time.perf_counter()
    while pending or live:
        pending.sort()
        while pending and pending[0][0] <= step:
            _, c, k = pending.pop(0)
            conv = convs[c]
            rid = f"c{c}t{k}"
            req = Request(
                request_id=rid,
                prompt_token_ids=conv.tokens[: conv.prompt_lens[k]].tolist(),
                sampling_params=SamplingParams(max_tokens=conv.output_lens[k], ignore_eos=True),
                pooling_params=None,
                block_hasher=hasher,
            )
            live[rid] = (req, c, k)
            sched.add_request(req)
        if not live:
            step = pending[0][0]
            continue
        out = sched.schedule()
        for new in out.scheduled_new_reqs:
            hits.setdefault(new.req_id, new.num_computed_tokens)
        ids = list(out.num_scheduled_tokens)
        sampled = []
        for rid in ids:
            req, c, _ = live[rid]
            if req.is_prefill_chunk:
                sampled.append([])
            else:
                sampled.append([int(convs[c].tokens[req.num_tokens])])
        result.max_running = max(result.max_running, len(sched.running))
        sched.update_from_output(
            out,
            ModelRunnerOutput(
                req_ids=ids,
                req_id_to_index={rid: i for i, rid in enumerate(ids)},
                sampled_token_ids=sampled,
            ),
        )
        for rid in ids:
            req, c, k = live[rid]
            if not req.is_finished():
                continue
            del live[rid]
            conv = convs[c]
            result.turns += 1
            result.prompt_tokens += conv.prompt_lens[k]
            result.hit_tokens += hits[rid]
            preemptions += req.num_preemptions
            if k + 1 < len(conv.prompt_lens):
                pending.append((step + 1 + conv.think[k + 1], c, k + 1))
            elif next_conv < len(convs):
                pending.append((step + 1 + convs[next_conv].think[0], next_conv, 0))
                next_conv += 1
        step += 1
        result.steps += 1
        if tick is not None and step % 256 == 0:
            tick()
    result.seconds = time.perf_counter() - t0
    result.preemptions = preemptions
    expected = sum(len(c.prompt_lens) for c in convs)
    if result.turns != expected:
        raise AssertionError(f"{name}: {result.turns} turns finished of {expected}")
    return result


def _distinct_blocks(convs: Sequence[Conversation], block_size: int) -> int:
    """Distinct full blocks of ``block_size`` tokens over every conversation's stream (a block
    is its whole prefix: conversations share the system prompt's)."""
    seen: set[bytes] = set()
    for c in convs:
        h = hashlib.sha256()
        tokens = np.ascontiguousarray(c.tokens, dtype=np.int64)
        for end in range(block_size, len(tokens) + 1, block_size):
            h.update(tokens[end - block_size : end].tobytes())
            seen.add(h.copy().digest())
    return len(seen)


def estimated_working_set(model: str, convs: Sequence[Conversation]) -> int:
    """kvforge-only sizing (``--no-vllm``): bytes that cache every distinct block of the
    workload in every group, at kvforge's device bytes per block."""
    from kvforge import CacheLayout

    layout = CacheLayout(kvforge_backends(model))
    return sum(
        _distinct_blocks(convs, g.block_size) * int(layout.bytes_per_block(g.name))
        for g in layout.groups
    )


# --- the benchmark ----------------------------------------------------------------------------


@dataclass
class PrefixRow:
    """One model at one memory size."""

    model: str
    size: str  # "1/4", "1/2", "1", "unbounded"
    fraction: str  # of the working set, e.g. "1/4" (the unbounded size is 4 W)
    working_set_bytes: int
    memory_bytes: int  # the budget both sides get: vLLM's backing, kvforge's memory_budget
    vllm_num_blocks: int | None = None
    vllm_bytes_per_block: int | None = None
    vllm_groups: list[str] | None = None
    vllm_block_size: int | None = None
    vllm_hash_block_size: int | None = None
    kvforge_plan_bytes: int | None = None
    kvforge_pool_bytes: int | None = None
    kvforge_pools: dict[str, int] | None = None
    kvforge_plan: list[str] | None = None
    #: slab arena only: slabs that changed hands, and cached blocks moved within a group
    #: (one block copy each) to pack blocks in use into few slabs
    kvforge_slab_moves: int | None = None
    kvforge_moved_blocks: int | None = None
    prompt_tokens: int = 0
    vllm_default_hit_tokens: int | None = None
    vllm_dense_hit_tokens: int | None = None
    kvforge_hit_tokens: int | None = None
    ratio_default: float | None = None  # kvforge / vLLM default
    ratio_dense: float | None = None  # kvforge / vLLM dense
    runs: dict[str, dict[str, Any]] = field(default_factory=dict)  # side -> SideResult
    errors: dict[str, str] = field(default_factory=dict)  # side -> why it did not run
    #: vLLM side -> whether vLLM's real Scheduler served the same hits, steps, preemptions
    scheduler_check: dict[str, bool] = field(default_factory=dict)


def _size_label(f: Fraction) -> str:
    return "unbounded" if f == UNBOUNDED else str(f)


def _record(row: PrefixRow, key: str, res: SideResult) -> None:
    row.runs[key] = asdict(res) | {"hit_rate": res.hit_rate}
    row.prompt_tokens = res.prompt_tokens
    setattr(row, f"{key}_hit_tokens", res.hit_tokens)


def _ratio(a: int | None, b: int | None) -> float | None:
    if a is None or b is None:
        return None
    if b == 0:
        return None if a == 0 else float("inf")
    return a / b


def run_prefix_vs_vllm(
    wl: PrefixWorkload,
    models: Sequence[str],
    sizes: Sequence[Fraction] = DEFAULT_SIZES,
    with_vllm: bool = True,
    kvforge_options: Mapping[str, Any] | None = None,
    progress: Any = None,
    check_scheduler: bool = True,
) -> list[PrefixRow]:
    """Every model at every size; see the module docstring. ``progress``: an object with
    ``start(label, total)``, ``advance()`` and ``tick()`` (or None). ``check_scheduler``: run
    every vLLM case again through vLLM's real ``Scheduler``
    (:func:`run_conversations_on_scheduler`) and record whether the manager run gave the
    same hits, steps, preemptions and peak rows (``PrefixRow.scheduler_check``)."""
    convs = make_conversations(wl)
    rows: list[PrefixRow] = []
    engine_args = {
        "max_model_len": wl.max_model_len,
        "max_num_seqs": wl.max_num_seqs,
        "max_num_batched_tokens": wl.max_num_batched_tokens,
    }
    vllm_args = dict(engine_args, long_prefill_token_threshold=wl.chunk_size)
    tick = progress.tick if progress is not None else None
    for model in models:
        if progress is not None:
            progress.start(model, len(sizes) * (3 if with_vllm else 1) + int(with_vllm))
        if with_vllm:
            import vllm_baseline as vb

            # a pool of every block of every turn in every group, plus the null block
            probe = vb.build_vllm_cache_setup(
                model, 1 << 40, retention_interval=RETENTION_DENSE, **vllm_args
            )
            sizes_ = [g.kv_cache_spec.block_size for g in probe.kv_cache_config.kv_cache_groups]
            every_block = 1 + sum(
                -(-(p + o) // b)
                for c in convs
                for p, o in zip(c.prompt_lens, c.output_lens, strict=True)
                for b in sizes_
            )
            setup = vb.build_vllm_cache_setup(
                model,
                every_block * probe.bytes_per_block,
                retention_interval=RETENTION_DENSE,
                **vllm_args,
            )
            side = VllmManagerSide(setup, "vLLM dense, every block")
            measured = run_conversations(wl, convs, side, tick)
            working_set = side.cached_blocks() * setup.bytes_per_block
            if progress is not None:
                progress.advance()
        else:
            working_set = estimated_working_set(model, convs)
            measured = None
        for f in sizes:
            memory = int(working_set * f)
            row = PrefixRow(
                model=model,
                size=_size_label(f),
                fraction=str(f),
                working_set_bytes=working_set,
                memory_bytes=memory,
            )
            if with_vllm:
                for key, retention in (
                    ("vllm_default", RETENTION_DEFAULT),
                    ("vllm_dense", RETENTION_DENSE),
                ):
                    try:
                        setup = vb.build_vllm_cache_setup(
                            model, memory, retention_interval=retention, **vllm_args
                        )
                    except ValueError as exc:
                        row.errors[key] = str(exc)
                        if progress is not None:
                            progress.advance()
                        continue
                    row.memory_bytes = setup.memory_bytes
                    row.vllm_num_blocks = setup.num_blocks
                    row.vllm_bytes_per_block = setup.bytes_per_block
                    row.vllm_groups = list(setup.groups)
                    row.vllm_block_size = setup.scheduler_block_size
                    row.vllm_hash_block_size = setup.hash_block_size
                    side = VllmManagerSide(setup, key)
                    res = run_conversations(wl, convs, side, tick)
                    _record(row, key, res)
                    if check_scheduler:
                        again = vb.build_vllm_cache_setup(
                            model, memory, retention_interval=retention, **vllm_args
                        )
                        real = run_conversations_on_scheduler(wl, convs, again, key, tick)
                        row.runs[f"{key}_scheduler"] = asdict(real) | {"hit_rate": real.hit_rate}
                        row.scheduler_check[key] = (
                            real.hit_tokens,
                            real.steps,
                            real.preemptions,
                            real.max_running,
                        ) == (res.hit_tokens, res.steps, res.preemptions, res.max_running)
                    if progress is not None:
                        progress.advance()
                if f == UNBOUNDED and measured is not None:
                    row.runs["vllm_dense_every_block"] = asdict(measured) | {
                        "hit_rate": measured.hit_rate
                    }
            try:
                manager, info = kvforge_manager(
                    model,
                    row.memory_bytes,
                    enable_prefix_caching=True,
                    options=kvforge_options,
                    **engine_args,
                )
            except ValueError as exc:
                row.errors["kvforge"] = str(exc)
            else:
                row.kvforge_plan_bytes = info["plan_bytes"]
                row.kvforge_pool_bytes = info["pool_bytes"]
                row.kvforge_pools = info["pools"]
                row.kvforge_plan = info["plan"]
                # admitted when its whole prompt fits, as vLLM's side is
                # (scheduler_reserve_full_isl), through BlockManager.prompt_fits
                side = KvforgeSide(manager, gate_chunk=wl.chunk_size)
                _record(row, "kvforge", run_conversations(wl, convs, side, tick))
                arena = getattr(manager, "arena", None)
                if arena is not None:
                    row.kvforge_slab_moves = arena.moves
                    row.kvforge_moved_blocks = getattr(arena, "moved_blocks", None)
            if progress is not None:
                progress.advance()
            row.ratio_default = _ratio(row.kvforge_hit_tokens, row.vllm_default_hit_tokens)
            row.ratio_dense = _ratio(row.kvforge_hit_tokens, row.vllm_dense_hit_tokens)
            rows.append(row)
    return rows


# --- output -----------------------------------------------------------------------------------


def _gib(n: int | None) -> str:
    return "-" if n is None else f"{n / (1 << 30):.2f}"


def _tokens(n: int | None, total: int) -> str:
    if n is None:
        return "-"
    return f"{n:,} ({100 * n / total:.1f}%)" if total else f"{n:,}"


def _r(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def print_rows(rows: Sequence[PrefixRow], out: Any, title: str) -> None:
    table = make_table(
        title,
        (
            "model",
            "size",
            "GiB",
            "prompt tokens",
            "vLLM default",
            "vLLM dense",
            "kvforge",
            "kvforge/default",
            "kvforge/dense",
            "preemptions v/d/k",
        ),
        ("model",),
    )
    for r in rows:
        pre = "/".join(
            str(r.runs[k]["preemptions"]) if k in r.runs else "-"
            for k in ("vllm_default", "vllm_dense", "kvforge")
        )
        table.add_row(
            r.model,
            r.size,
            _gib(r.memory_bytes),
            f"{r.prompt_tokens:,}",
            _tokens(r.vllm_default_hit_tokens, r.prompt_tokens),
            _tokens(r.vllm_dense_hit_tokens, r.prompt_tokens),
            _tokens(r.kvforge_hit_tokens, r.prompt_tokens),
            _r(r.ratio_default),
            _r(r.ratio_dense),
            pre,
        )
    out.print(table)
    checks = [(r, k, ok) for r in rows for k, ok in r.scheduler_check.items()]
    if checks:
        bad = [f"{r.model} {r.size} {k}" for r, k, ok in checks if not ok]
        out.print(
            f"  vLLM's real Scheduler, run on the same conversations, served the same hits, "
            f"steps and preemptions as the manager runs in {len(checks) - len(bad)} of "
            f"{len(checks)} cases" + (f"; NOT in {', '.join(bad)}" if bad else "")
        )
    for r in rows:
        for side, why in r.errors.items():
            out.print(f"  {r.model} {r.size}: {side} did not run: {short_reason(why)}")


def short_reason(message: str, limit: int = 160) -> str:
    """The first sentence of an error message, at most ``limit`` characters (the JSON keeps
    the whole message)."""
    text = " ".join(message.split())
    cut = text.find(". ", 40)
    if 0 < cut < limit:
        return text[: cut + 1]
    return text if len(text) <= limit else text[: limit - 3] + "..."


class _Progress:
    """A rich progress bar: one task per model, advanced per run, refreshed while runs go."""

    def __init__(self, bar: Any) -> None:
        self.bar = bar
        self.task: Any = None

    def start(self, label: str, total: int) -> None:
        if self.task is not None:
            self.bar.update(self.task, completed=self.bar.tasks[self.task].total)
        self.task = self.bar.add_task(label, total=total)

    def advance(self) -> None:
        self.bar.advance(self.task)

    def tick(self) -> None:
        self.bar.refresh()


def _progress_bar(enabled: bool, out: Any) -> Iterator[Any]:
    if not enabled:
        yield None
        return
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
        TimeElapsedColumn(),
        console=out,
        transient=False,
    ) as bar:
        yield _Progress(bar)


def environment(with_vllm: bool) -> dict[str, Any]:
    env: dict[str, Any] = {
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "load_before": [round(x, 2) for x in os.getloadavg()],
        "vllm": None,
    }
    if with_vllm:
        import vllm

        env["vllm"] = vllm.__version__
    env.update(_checkout())
    return env


def _checkout() -> dict[str, Any]:
    """The commit kvforge ran from and its files that differ from it (other work in the
    checkout changes kvforge's defaults: the figures are those of this tree)."""
    import subprocess

    root = Path(__file__).resolve().parents[1]

    def git(*args: str) -> str:
        try:
            return subprocess.run(
                ["git", *args], cwd=root, capture_output=True, text=True, timeout=30, check=True
            ).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    changed = git("status", "--porcelain", "--", "kvforge")
    return {
        "commit": git("rev-parse", "HEAD") or None,
        "kvforge_changed_files": [line.split(maxsplit=1)[-1] for line in changed.splitlines()],
    }


def _workload_dict(wl: PrefixWorkload) -> dict[str, Any]:
    return wl.model_dump()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=None, help=f"comma-separated, of {', '.join(MODELS)}")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="a small workload (tests)")
    parser.add_argument("--json", default=None, metavar="PATH", help="write the rows here")
    parser.add_argument("--no-vllm", action="store_true", help="kvforge only")
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument(
        "--no-scheduler-check",
        action="store_true",
        help="skip re-running every vLLM case through vLLM's real Scheduler",
    )
    parser.add_argument(
        "--kvforge-option",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="an option for kvforge's plan_memory / BlockManager (repeatable)",
    )
    args = parser.parse_args(argv)
    models = list(MODELS)
    if args.models:
        models = [m.strip() for m in args.models.split(",") if m.strip()]
        unknown = [m for m in models if m not in MODELS]
        if unknown:
            parser.error(f"--models: unknown {unknown}; known: {', '.join(MODELS)}")
    try:
        options = parse_kvforge_options(args.kvforge_option)
    except ValueError as exc:
        parser.error(str(exc))
    out = console()
    with_vllm = not args.no_vllm
    if with_vllm and not vllm_available():
        out.print(
            f"vLLM {VLLM_VERSION} is not importable here: run with ~/.venv-vllm/bin/python "
            "(PYTHONPATH=.; see docs/vllm_baseline.md), or pass --no-vllm for the "
            "kvforge side alone"
        )
        return 2
    wl = prefix_workload(args.seed, args.quick)
    env = environment(with_vllm)
    settings = kvforge_settings(options)
    out.print(
        f"python {env['python']}, {env['cpu_count']} cpus, load {env['load_before'][0]}, "
        f"vLLM {env['vllm'] or 'absent (kvforge only)'}; seed {wl.seed}, "
        f"{wl.num_conversations} conversations, {wl.concurrency} open, {wl.max_num_seqs} running, "
        f"max_model_len {wl.max_model_len}; kvforge share_pools="
        f"{settings['controller'].get('share_pools')}, options {settings['options'] or 'none'}"
    )
    t0 = time.perf_counter()
    gen = _progress_bar(not args.no_progress, out)
    progress = next(gen)
    try:
        rows = run_prefix_vs_vllm(
            wl,
            models,
            DEFAULT_SIZES,
            with_vllm,
            options,
            progress,
            check_scheduler=not args.no_scheduler_check,
        )
    finally:
        gen.close()
    env["seconds"] = round(time.perf_counter() - t0, 1)
    env["load_after"] = [round(x, 2) for x in os.getloadavg()]
    print_rows(
        rows,
        out,
        "prefix hit tokens at equal bytes (share of prompt tokens); sizes are fractions of the "
        "working set" + (" (vLLM dense)" if with_vllm else " (estimated from kvforge pages)"),
    )
    if args.json:
        data = {
            "environment": env,
            "workload": _workload_dict(wl),
            "kvforge": settings,
            "rows": [asdict(r) for r in rows],
        }
        Path(args.json).write_text(json.dumps(data, indent=1) + "\n")
        out.print(f"wrote {len(rows)} rows to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
