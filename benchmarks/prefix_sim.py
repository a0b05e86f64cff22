"""Prefix-reuse benchmark, kvforge side: seeded multi-turn conversations through ``BlockManager``.

A workload (:class:`PrefixWorkload`) is a seeded set of synthetic conversations that share one
system prompt (:func:`make_conversations`). An engine loop (:func:`simulate`) feeds them to a
cache model as a serving engine would: at most ``concurrency`` conversations are open, a turn's
prompt is the whole conversation so far plus the new user message, prompts are prefilled in
chunks of at most ``chunk_size`` tokens under a per-step budget of ``max_num_batched_tokens``,
outputs are decoded one token per step, and the next turn of a conversation arrives a seeded
number of steps after the previous one finished. Every step is one ``schedule`` call for the
whole batch, with the token ids of every scheduled token (so completed blocks become
reusable), and new requests carry the match their ``lookup`` returned.

Cache models driven by the same loop:

- :class:`ManagerModel`: a real :class:`~kvforge.cache_controller.BlockManager` with prefix
  caching; the runs share pools between groups whose pages pair up (``share_pools=True``:
  gpt-oss's full and sliding-window groups draw on one pool). With unbounded pools it is the
  *aligned oracle*.
- :class:`LruModel`: the *plain LRU* baseline, a small simulation with one byte budget shared
  by every group's blocks, least recently released evicted first whatever its family, and the
  same boundary rule for a hit (the rule of ``BlockManager.lookup``).

At each memory size ``M`` (the same fraction of every group's working set), kvforge's pools
are split as its planner sizes a deployment (:func:`split_pools`): each window/state group
gets the planner's reserve (:func:`floor_blocks`: live windows of every running request plus
one step's allowance) plus a tail cache measured by :func:`tail_cache`, the full groups the
rest; groups that share a pool then pool their blocks (``shared_pool_blocks``, as
``CacheController(share_pools=True)`` sizes them). The plain LRU
gets exactly the bytes of those blocks.

Per run (:func:`run_prefix_bench`) the figures are token hit rates over prompt tokens:
``hit_rate`` (the run), ``oracle_hit_rate`` (unbounded pools), ``token_oracle_hit_rate`` (any
earlier token prefix, no alignment), ``lru_hit_rate`` (plain LRU at the same bytes) and
``history_only_hit_rate`` (full groups only, window tails recomputed); see
``docs/performance.md`` ("Prefix reuse") for the exact definitions and the workload's
distributions.

Invariants: the same workload (seed included) always gives the same conversations, the same
schedule for a given cache model and memory, and the same hit counts; a turn's hit is counted
once, at the step its request is first accepted. This module imports no vLLM.
"""

from __future__ import annotations

import gc
import json
import math
import statistics
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Any, Protocol

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

from kvforge.core.layout import CacheLayout
from kvforge.core.memory_plan import shared_pool_blocks
from kvforge.core.prefix_keys import PrefixHasher
from kvforge.core.values import PrefixMatch, PrefixQuery
from kvforge.scheduler.block_manager import BlockManager
from kvforge.specs import CacheGroup

__all__ = [
    "DEFAULT_FRACTIONS",
    "MODELS",
    "Conversation",
    "LruModel",
    "ManagerModel",
    "PrefixRecord",
    "PrefixWorkload",
    "RunResult",
    "build_layout",
    "floor_blocks",
    "make_conversations",
    "measure_cost",
    "print_prefix_table",
    "run_prefix_bench",
    "simulate",
    "split_pools",
    "tail_blocks",
    "tail_cache",
    "working_set",
    "write_prefix_json",
]

#: memory sizes, as fractions of the working set (1: nothing is ever evicted)
DEFAULT_FRACTIONS: tuple[Fraction, ...] = (
    Fraction(1),
    Fraction(3, 4),
    Fraction(1, 2),
    Fraction(3, 8),
    Fraction(1, 4),
)
#: bundled model configs the benchmark runs: name -> config name for ``from_hf_config``
MODELS: dict[str, str] = {
    "deepseek-v4-flash": "deepseek-v4-flash",
    "llama-3-8b": "llama-3-8b",
    "gpt-oss-20b": "gpt-oss-20b",
}


# --- the workload -------------------------------------------------------------------------------


class PrefixWorkload(BaseModel):
    """Seeded multi-turn conversations and how the engine loop serves them.

    Lengths are in tokens. User messages and model outputs are log-normal: ``exp(N(ln median,
    sigma))`` rounded to an int and clipped to ``[1, max]``.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    seed: int = 0
    num_conversations: int = Field(64, ge=1)
    concurrency: int = Field(32, ge=1)
    max_num_seqs: int = Field(16, ge=1)
    system_prompt_len: int = Field(700, ge=0)
    min_turns: int = Field(2, ge=1)
    max_turns: int = Field(8, ge=1)
    user_median: float = Field(64.0, gt=0)
    user_sigma: float = Field(1.2, ge=0)
    user_max: int = Field(4096, ge=1)
    output_median: float = Field(192.0, gt=0)
    output_sigma: float = Field(0.9, ge=0)
    output_max: int = Field(2048, ge=1)
    think_min: int = Field(8, ge=0)
    think_max: int = Field(64, ge=0)
    chunk_size: int = Field(2048, ge=1)
    max_num_batched_tokens: int = Field(4096, ge=1)
    max_model_len: int = Field(32768, ge=2)
    vocab_size: int = Field(128_000, ge=2)

    @model_validator(mode="after")
    def _check_ranges(self) -> PrefixWorkload:
        if self.max_turns < self.min_turns:
            raise ValueError(
                f"max_turns must be >= min_turns ({self.min_turns}), got {self.max_turns}"
            )
        if self.think_max < self.think_min:
            raise ValueError(
                f"think_max must be >= think_min ({self.think_min}), got {self.think_max}"
            )
        if self.system_prompt_len + 2 > self.max_model_len:
            raise ValueError(
                f"max_model_len {self.max_model_len} leaves no room after the system prompt "
                f"of system_prompt_len={self.system_prompt_len} tokens"
            )
        return self


@dataclass(frozen=True)
class Conversation:
    """One conversation: its token stream and, per turn, the prompt and output lengths.

    ``tokens`` is the whole conversation (system prompt, user 1, output 1, user 2, ...); turn
    ``k``'s prompt is ``tokens[:prompt_lens[k]]`` and its output the next ``output_lens[k]``
    tokens. ``think[k]`` is the steps between turn ``k - 1`` finishing and turn ``k``
    arriving (``think[0]`` delays the first turn after the conversation opens).
    """

    index: int
    tokens: np.ndarray
    prompt_lens: tuple[int, ...]
    output_lens: tuple[int, ...]
    think: tuple[int, ...]


def _lognormal(rng: np.random.Generator, median: float, sigma: float, high: int, n: int):
    values = np.rint(np.exp(rng.normal(math.log(median), sigma, n))).astype(np.int64)
    return np.clip(values, 1, high)


def make_conversations(wl: PrefixWorkload) -> list[Conversation]:
    """The workload's conversations; the same ``wl`` always gives the same ones.

    Token ids are uniform in ``[0, vocab_size)``: conversations share the system prompt and,
    beyond it, only what chance gives. Turns that would not fit ``max_model_len`` (prompt plus
    output) are dropped; every conversation keeps at least one turn.
    """
    rng = np.random.default_rng(wl.seed)
    system = rng.integers(0, wl.vocab_size, wl.system_prompt_len, dtype=np.int64)
    out = []
    for c in range(wl.num_conversations):
        turns = int(rng.integers(wl.min_turns, wl.max_turns + 1))
        users = _lognormal(rng, wl.user_median, wl.user_sigma, wl.user_max, turns)
        outputs = _lognormal(rng, wl.output_median, wl.output_sigma, wl.output_max, turns)
        think = rng.integers(wl.think_min, wl.think_max + 1, turns)
        prompts: list[int] = []
        outs: list[int] = []
        length = wl.system_prompt_len
        for k in range(turns):
            prompt = length + int(users[k])
            end = prompt + int(outputs[k])
            if end > wl.max_model_len:
                if k == 0:  # a single turn that fits: the user message is cut
                    prompt = min(prompt, wl.max_model_len - 1)
                    prompts.append(prompt)
                    outs.append(max(1, min(int(outputs[k]), wl.max_model_len - prompt)))
                break
            prompts.append(prompt)
            outs.append(int(outputs[k]))
            length = end
        total = prompts[-1] + outs[-1]
        body = rng.integers(0, wl.vocab_size, total - wl.system_prompt_len, dtype=np.int64)
        out.append(
            Conversation(
                index=c,
                tokens=np.concatenate([system, body]),
                prompt_lens=tuple(prompts),
                output_lens=tuple(outs),
                think=tuple(int(t) for t in think[: len(prompts)]),
            )
        )
    return out


# --- cache models -------------------------------------------------------------------------------


@dataclass
class _Request:
    rid: str
    conv: Conversation
    turn: int
    prompt_len: int
    end_len: int  # tokens whose KV is computed when it finishes: prompt + output - 1
    computed: int = 0
    counted: bool = False


class CacheModel(Protocol):
    """What the engine loop drives: a lookup per new request, one schedule call per step."""

    def lookup(self, req: _Request) -> tuple[int, object]: ...

    def schedule(
        self,
        reqs: Sequence[_Request],
        counts: Sequence[int],
        matches: Sequence[object | None],
    ) -> set[str]: ...

    def finish(self, rids: Sequence[str]) -> None: ...


class ManagerModel:
    """The real scheduler side: a ``BlockManager`` with prefix caching (pools shared where
    groups pair up, when ``share_pools``)."""

    def __init__(
        self,
        layout: CacheLayout,
        num_blocks: Mapping[str, int],
        max_num_seqs: int,
        max_model_len: int,
        share_pools: bool = False,
    ) -> None:
        self.manager = BlockManager(
            layout,
            num_blocks,
            max_num_seqs,
            max_model_len,
            enable_prefix_caching=True,
            share_pools=share_pools,
        )
        self.peak = {g: 0 for g in self.manager.groups}  # blocks in use or cached, at most
        self.live_peak = {g: 0 for g in self.manager.groups}  # blocks in use, at most
        self.lookup_ns: list[int] = []

    def lookup(self, req: _Request) -> tuple[int, object]:
        query = [PrefixQuery(req.conv.tokens[: req.prompt_len])]
        t0 = time.perf_counter_ns()
        match = self.manager.lookup(query)[0]
        self.lookup_ns.append(time.perf_counter_ns() - t0)
        return match.num_tokens, match

    def schedule(
        self,
        reqs: Sequence[_Request],
        counts: Sequence[int],
        matches: Sequence[object | None],
    ) -> set[str]:
        tokens = []
        for r, n, m in zip(reqs, counts, matches, strict=True):
            start = r.computed if m is None else m.num_tokens  # type: ignore[attr-defined]
            tokens.append(r.conv.tokens[start : start + n])
        alloc = self.manager.schedule(
            [r.rid for r in reqs],
            list(counts),
            new_token_ids=tokens,
            prefix_matches=list(matches),  # type: ignore[arg-type]
        )
        self.manager.end_step(alloc)  # a synchronous engine: the step's kernels have run
        for g in self.peak:
            pool = self.manager.pool(g)
            self.peak[g] = max(self.peak[g], pool.num_used + pool.num_evictable)
            self.live_peak[g] = max(self.live_peak[g], pool.num_used)
        return {r.request_id for r in alloc.refused}

    def finish(self, rids: Sequence[str]) -> None:
        self.manager.finish(list(rids))

    @property
    def evictions(self) -> dict[str, int]:
        return dict(sorted(self.manager.prefix_stats.evictions.items()))


@dataclass
class _LruRow:
    """One request's held blocks in the LRU simulation, per group: column -> key (``None``
    for a block that holds no key: its prefix was cached by another block already)."""

    cols: list[dict[int, object]]
    held_from: list[int]
    committed: list[int]
    num_tokens: int = 0


class LruModel:
    """The plain-LRU baseline: one byte budget for every group's blocks.

    Blocks are ``(group, prefix key)`` pairs. A block in use by a request counts against the
    budget; a keyed block no request uses stays cached (evictable) until the budget needs its
    bytes, least recently released first, whatever its group or family. Growth, window
    release, commit and the hit rule are those of ``BlockManager`` (a hit at ``L``: every full
    group holds the chain ``[0, L)``, every window/state group the blocks of the window the
    next token reads; a window/state block no boundary's tail holds is never cached). As
    ``BlockManager.schedule``: every new request of a step first shares
    its match (a stale one is refused), then requests grow in order, each released before it
    grows; one that does not fit is refused, and a refused new request gives its shared blocks
    back after the step. With one full group this is ``BlockManager``'s policy exactly: the
    same hits per turn and the same evictions at the same memory.
    """

    def __init__(self, layout: CacheLayout, budget_bytes: int, keys: Callable[..., object]):
        self.groups: list[CacheGroup] = list(layout.groups)
        self.bytes = [int(layout.bytes_per_block(g.name)) for g in self.groups]
        self.family = [g.family.value for g in self.groups]
        self.full = [g.kind.value == "full" for g in self.groups]
        self.boundary = math.lcm(*(g.block_size for g in self.groups))
        self.budget = budget_bytes
        self.key_at = keys  # (conversation, prefix length) -> key
        self.live_bytes = 0
        self.cached_bytes = 0
        self.refs: dict[tuple[int, object], int] = {}  # keyed blocks in use
        self.evictable: OrderedDict[tuple[int, object], None] = OrderedDict()
        self.rows: dict[str, _LruRow] = {}
        self.evictions: dict[str, int] = {}

    def _present(self, gi: int, key: object) -> bool:
        return (gi, key) in self.refs or (gi, key) in self.evictable

    def lookup(self, req: _Request) -> tuple[int, object]:
        n = req.prompt_len
        step = self.boundary
        upper = ((n - 1) // step) * step if n else 0
        conv = req.conv.index
        for gi, g in enumerate(self.groups):
            if self.full[gi]:
                i = 0
                while (i + 1) * g.block_size <= upper and self._present(
                    gi, self.key_at(conv, (i + 1) * g.block_size)
                ):
                    i += 1
                upper = min(upper, i * g.block_size)
        length = (upper // step) * step
        while length > 0 and not self._tails_present(conv, length):
            length -= step
        return length, length

    def _tail_cols(self, g: CacheGroup, length: int) -> range:
        # the window the next token reads (BlockManager._window_start); full: the chain
        start = max(0, length + 1 - int(g.window or 0)) if g.kind.value != "full" else 0
        return range(start // g.block_size, length // g.block_size)

    def _in_some_tail(self, g: CacheGroup, col: int) -> bool:
        # the first boundary at or after the block's end decides (BlockManager._in_some_tail)
        end = (col + 1) * g.block_size
        first = -(-end // self.boundary) * self.boundary
        return self._tail_cols(g, first).start <= col

    def _tails_present(self, conv: int, length: int) -> bool:
        for gi, g in enumerate(self.groups):
            if not self.full[gi]:
                for c in self._tail_cols(g, length):
                    if not self._present(gi, self.key_at(conv, (c + 1) * g.block_size)):
                        return False
        return True

    def _share(self, gi: int, key: object) -> None:
        k = (gi, key)
        if k in self.evictable:
            del self.evictable[k]
            self.cached_bytes -= self.bytes[gi]
            self.live_bytes += self.bytes[gi]
            self.refs[k] = 1
        else:
            self.refs[k] += 1

    def _release(self, gi: int, key: object | None) -> None:
        if key is None:
            self.live_bytes -= self.bytes[gi]
            return
        k = (gi, key)
        self.refs[k] -= 1
        if self.refs[k] == 0:
            del self.refs[k]
            self.live_bytes -= self.bytes[gi]
            self.cached_bytes += self.bytes[gi]
            self.evictable[k] = None

    def _evict_for(self, need: int) -> None:
        while self.live_bytes + self.cached_bytes + need > self.budget:
            (gi, _), _ = self.evictable.popitem(last=False)
            self.cached_bytes -= self.bytes[gi]
            fam = self.family[gi]
            self.evictions[fam] = self.evictions.get(fam, 0) + 1

    def schedule(
        self,
        reqs: Sequence[_Request],
        counts: Sequence[int],
        matches: Sequence[object | None],
    ) -> set[str]:
        # As BlockManager.schedule: every new request's match is shared first (so growth of
        # the requests before it in the step cannot evict it), then requests grow in order;
        # a refused new request gives its shared blocks back after the whole step.
        refused: set[str] = set()
        rows: list[_LruRow | None] = []
        for r, m in zip(reqs, matches, strict=True):
            row = self.rows.get(r.rid)
            if row is None:
                row = self._adopt(r, int(m) if m is not None else 0)  # type: ignore[call-overload]
                if row is None:
                    refused.add(r.rid)
            rows.append(row)
        undo: list[_LruRow] = []
        for r, n, row in zip(reqs, counts, rows, strict=True):
            if row is None:
                continue
            if self._grow(r, row, n):
                self.rows[r.rid] = row
            else:
                refused.add(r.rid)
                if r.rid not in self.rows:
                    undo.append(row)
        for row in undo:
            self._undo_share(row)
        return refused

    def _adopt(self, r: _Request, length: int) -> _LruRow | None:
        """A new request's row sharing its match's blocks; ``None`` when a matched block was
        evicted since the lookup (a stale match, refused as BlockManager refuses it)."""
        conv = r.conv.index
        row = _LruRow([{} for _ in self.groups], [0] * len(self.groups), [0] * len(self.groups))
        if not length:
            return row
        shared = [
            range(0, length // g.block_size) if self.full[gi] else self._tail_cols(g, length)
            for gi, g in enumerate(self.groups)
        ]
        if not all(
            self._present(gi, self.key_at(conv, (c + 1) * g.block_size))
            for gi, g in enumerate(self.groups)
            for c in shared[gi]
        ):
            return None
        for gi, g in enumerate(self.groups):
            cols = shared[gi]
            for c in cols:
                key = self.key_at(conv, (c + 1) * g.block_size)
                self._share(gi, key)
                row.cols[gi][c] = key
            row.held_from[gi] = cols.start
            row.committed[gi] = length // g.block_size
        row.num_tokens = length
        return row

    def _grow(self, r: _Request, row: _LruRow, n: int) -> bool:
        conv = r.conv.index
        before = row.num_tokens
        after = before + n
        releases: list[tuple[int, int]] = []
        need = 0
        freed = 0
        for gi, g in enumerate(self.groups):
            bs = g.block_size
            old_len = -(-before // bs)
            need += (-(-after // bs) - old_len) * self.bytes[gi]
            if not self.full[gi]:
                first_read = before if after > before else max(before - 1, 0)
                start = max(0, first_read + 1 - int(g.window or 0))
                hi = max(row.held_from[gi], min(start // bs, old_len))
                for c in range(row.held_from[gi], hi):
                    key = row.cols[gi].get(c, None)
                    releases.append((gi, c))
                    if key is None or self.refs.get((gi, key)) == 1:
                        freed += self.bytes[gi]  # leaves use: freed, or cached (evictable)
        # cached bytes can always be evicted: only blocks in use limit growth
        if self.live_bytes - freed + need > self.budget:
            return False
        for gi, c in releases:
            self._release(gi, row.cols[gi].pop(c))
        for gi, g in enumerate(self.groups):
            if not self.full[gi]:
                bs = g.block_size
                first_read = before if after > before else max(before - 1, 0)
                start = max(0, first_read + 1 - int(g.window or 0))
                row.held_from[gi] = max(row.held_from[gi], min(start // bs, -(-before // bs)))
        self._evict_for(need)
        self.live_bytes += need
        for gi, g in enumerate(self.groups):
            bs = g.block_size
            for c in range(-(-before // bs), -(-after // bs)):
                row.cols[gi][c] = None
            # commit: completed blocks take their prefix key unless it is cached already or,
            # in a window/state group, no boundary's tail holds it (BlockManager._commit)
            for c in range(row.committed[gi], after // bs):
                if not self.full[gi] and not self._in_some_tail(g, c):
                    continue
                if c in row.cols[gi] and row.cols[gi][c] is None:
                    key = self.key_at(conv, (c + 1) * bs)
                    if not self._present(gi, key):
                        self.refs[(gi, key)] = 1
                        row.cols[gi][c] = key
            row.committed[gi] = after // bs
        row.num_tokens = after
        return True

    def _undo_share(self, row: _LruRow) -> None:
        for gi in range(len(self.groups)):
            for c in sorted(row.cols[gi], reverse=True):
                self._release(gi, row.cols[gi][c])

    def finish(self, rids: Sequence[str]) -> None:
        rows = [self.rows.pop(rid) for rid in rids]
        for gi in range(len(self.groups)):
            # BlockManager.finish releases the rows' blocks in one BlockPool.release call,
            # which makes them evictable in reverse: the last request's deepest block first
            # (the least recent), the first request's root last
            for row in reversed(rows):
                for c in sorted(row.cols[gi], reverse=True):
                    self._release(gi, row.cols[gi][c])


# --- the engine loop ----------------------------------------------------------------------------


@dataclass
class RunResult:
    """What one run of the engine loop measured (token counts are exact)."""

    prompt_tokens: int = 0
    hit_tokens: int = 0
    token_oracle_tokens: int = 0
    hits: list[int] = field(default_factory=list)  # per turn, in the order turns were admitted
    prompts: list[int] = field(default_factory=list)
    steps: int = 0
    preemptions: int = 0
    max_running: int = 0


def _pairwise_lcp(convs: Sequence[Conversation]) -> np.ndarray:
    n = len(convs)
    out = np.zeros((n, n), dtype=np.int64)
    for i in range(n):
        a = convs[i].tokens
        out[i, i] = len(a)
        for j in range(i + 1, n):
            b = convs[j].tokens
            m = min(len(a), len(b))
            diff = np.flatnonzero(a[:m] != b[:m])
            out[i, j] = out[j, i] = int(diff[0]) if len(diff) else m
    return out


def simulate(
    wl: PrefixWorkload,
    convs: Sequence[Conversation],
    model: CacheModel,
    max_num_seqs: int | None = None,
) -> RunResult:
    """Serve every turn of ``convs`` through ``model``; per-turn hits and the token oracle.

    Per step: running requests first, in admission order (a decode takes one token, a prefill
    the rest of its prompt up to ``chunk_size`` and the step budget), then waiting turns in
    arrival order while budget and rows last, each looked up just before its first step. A
    new request refused by the model waits (and is looked up again); a running one refused
    is preempted (finished, and its turn starts over, its hit already counted).
    """
    seqs = max_num_seqs if max_num_seqs is not None else wl.max_num_seqs
    turns = sum(len(c.prompt_lens) for c in convs)
    lcp = _pairwise_lcp(convs)
    known = np.zeros(len(convs), dtype=np.int64)  # tokens of each stream any cache could hold
    result = RunResult()
    pending: list[tuple[int, int, int]] = []  # (due step, conversation, turn)
    next_conv = 0
    step = 0
    for _ in range(min(wl.concurrency, len(convs))):
        pending.append((convs[next_conv].think[0], next_conv, 0))
        next_conv += 1
    waiting: list[_Request] = []
    running: list[_Request] = []
    idle = 0
    while pending or waiting or running:
        pending.sort()
        while pending and pending[0][0] <= step:
            _, c, k = pending.pop(0)
            conv = convs[c]
            p = conv.prompt_lens[k]
            waiting.append(_Request(f"c{c}t{k}", conv, k, p, p + conv.output_lens[k] - 1))
        if not waiting and not running:
            step = pending[0][0]
            continue
        budget = wl.max_num_batched_tokens
        batch: list[_Request] = []
        counts: list[int] = []
        matches: list[object | None] = []
        for r in running:
            n = (
                1
                if r.computed >= r.prompt_len
                else min(wl.chunk_size, r.prompt_len - r.computed, budget)
            )
            if n <= 0 or budget <= 0:
                continue
            budget -= n
            batch.append(r)
            counts.append(n)
            matches.append(None)
        admitted: list[tuple[_Request, int]] = []
        for r in list(waiting):
            if budget <= 0 or len(running) + len(admitted) >= seqs:
                break
            length, match = model.lookup(r)
            n = min(wl.chunk_size, r.prompt_len - length, budget)
            budget -= n
            batch.append(r)
            counts.append(n)
            matches.append(match)
            admitted.append((r, length))
        refused = model.schedule(batch, counts, matches) if batch else set()
        for r, length in admitted:
            if r.rid in refused:
                continue
            waiting.remove(r)
            running.append(r)
            r.computed = length
            if not r.counted:
                r.counted = True
                c = r.conv.index
                oracle = int(np.minimum(lcp[c], known).max())
                result.token_oracle_tokens += min(oracle, r.prompt_len - 1)
                result.hit_tokens += length
                result.prompt_tokens += r.prompt_len
                result.hits.append(length)
                result.prompts.append(r.prompt_len)
            known[r.conv.index] = max(known[r.conv.index], r.prompt_len)
        done: list[_Request] = []
        preempted: list[_Request] = []
        for r, n in zip(batch, counts, strict=True):
            if r.rid in refused:
                if r in running:
                    preempted.append(r)
                continue
            r.computed += n
            known[r.conv.index] = max(known[r.conv.index], r.computed)
            if r.computed >= r.end_len:
                done.append(r)
        if preempted:
            model.finish([r.rid for r in preempted])
            for r in preempted:
                running.remove(r)
                r.computed = 0
            waiting[:0] = preempted
            result.preemptions += len(preempted)
        if done:
            model.finish([r.rid for r in done])
            for r in done:
                running.remove(r)
                conv = r.conv
                if r.turn + 1 < len(conv.prompt_lens):
                    pending.append((step + 1 + conv.think[r.turn + 1], conv.index, r.turn + 1))
                elif next_conv < len(convs):
                    pending.append((step + 1 + convs[next_conv].think[0], next_conv, 0))
                    next_conv += 1
        result.max_running = max(result.max_running, len(running))
        idle = idle + 1 if not batch or len(refused) == len(batch) else 0
        if result.preemptions > 4 * turns:
            raise RuntimeError(
                f"{result.preemptions} preemptions for {turns} turns: the memory cannot hold "
                "the running requests (thrashing)"
            )
        if idle > 1000:
            raise RuntimeError(
                f"no request could be scheduled for {idle} steps (step {step}, "
                f"{len(waiting)} waiting, {len(running)} running): the memory is too small "
                "for one request"
            )
        step += 1
    result.steps = step
    return result


# --- layouts, working set, runs -----------------------------------------------------------------


def build_layout(model: str) -> CacheLayout:
    """The cache layout of a bundled model config (``MODELS``)."""
    from kvforge.models import from_hf_config

    if model not in MODELS:
        raise ValueError(f"model must be one of {sorted(MODELS)}, got {model!r}")
    return CacheLayout(from_hf_config(MODELS[model]))


def _unbounded_blocks(layout: CacheLayout, convs: Sequence[Conversation]) -> dict[str, int]:
    # every block any request could ever take, plus the null block: nothing is evicted
    out = {}
    for g in layout.groups:
        total = sum(
            -(-(p + o) // g.block_size) + 1
            for c in convs
            for p, o in zip(c.prompt_lens, c.output_lens, strict=True)
        )
        out[g.name] = total + 2
    return out


def _allowance(g: CacheGroup, wl: PrefixWorkload) -> int:
    """The batch-wide step allowance a memory plan gives every window/state group
    (``cdiv(max_num_batched_tokens, B) + max_num_seqs``): a step holds a block for every
    token it schedules until the request's next step, so a plan keeps this reserve on top of
    the live windows (see ``kvforge.core.memory_plan``)."""
    if g.kind.value == "full":
        return 0
    return -(-wl.max_num_batched_tokens // g.block_size) + wl.max_num_seqs


def working_set(layout: CacheLayout, wl: PrefixWorkload, peak: Mapping[str, int]) -> dict[str, int]:
    """Per group, usable blocks at which nothing is ever evicted: the most blocks the group
    held (in use or cached) in the run with unbounded pools, plus one step's release
    allowance for window/state groups."""
    return {g.name: peak[g.name] + _allowance(g, wl) for g in layout.groups}


def floor_blocks(
    layout: CacheLayout, wl: PrefixWorkload, live_peak: Mapping[str, int]
) -> dict[str, int]:
    """Per group, the usable blocks a pool never goes below: for a full group what the
    running requests held at once in the unbounded run (``live_peak``); for a window/state
    group the reserve kvforge's planner gives a deployment, ``max_num_seqs`` live windows
    plus the batch-wide step allowance (:func:`_allowance`), which bounds what any step can
    hold whatever the workload.

    DeepSeek-V4-Flash ``c4_state`` (4-token blocks, window 8) at 16 sequences and 4,096
    batched tokens: ``16 * 3 + (1024 + 16) = 1,088`` blocks.
    """
    out = {}
    for g in layout.groups:
        if g.kind.value == "full":
            out[g.name] = live_peak[g.name]
        else:
            live = g.max_live_blocks(wl.max_model_len)
            out[g.name] = wl.max_num_seqs * live + _allowance(g, wl)
    return out


def _pools(ws: Mapping[str, int], fraction: Fraction, floor: Mapping[str, int]) -> dict[str, int]:
    # usable blocks scaled by the same fraction for every group, plus the null block; never
    # below what the running requests hold at once (``floor``), which only caching may use.
    # Only the memory size M is taken from this (see ``split_pools`` for kvforge's pools).
    return {g: max(floor[g], math.ceil(n * fraction)) + 1 for g, n in ws.items()}


def tail_blocks(layout: CacheLayout, g: CacheGroup) -> int:
    """Blocks of window/state group ``g`` that one hit reads: those covering the window the
    next token reads at a boundary ``L >= window`` (0 for a full group)."""
    if g.kind.value == "full":
        return 0
    boundary = math.lcm(*(h.block_size for h in layout.groups))
    window = int(g.window or 0)
    length = -(-window // boundary) * boundary + boundary  # a boundary past one window
    start = max(0, length + 1 - window)
    return length // g.block_size - start // g.block_size


def _window_pools(
    layout: CacheLayout, ws: Mapping[str, int], floor: Mapping[str, int], tails: int
) -> dict[str, int]:
    # usable blocks of the window/state groups: the floor plus ``tails`` cached tails, capped
    # at the working set (more is never used)
    return {
        g.name: min(ws[g.name], floor[g.name] + tails * tail_blocks(layout, g))
        for g in layout.groups
        if g.kind.value != "full"
    }


def tail_cache(
    layout: CacheLayout,
    wl: PrefixWorkload,
    convs: Sequence[Conversation],
    ws: Mapping[str, int],
    floor: Mapping[str, int],
    oracle_hits: int,
) -> int:
    """The tail cache, in tails: the smallest ``k`` (bisection) such that window/state pools
    of ``floor + k * tail_blocks`` blocks, with unbounded full pools, serve exactly the aligned
    oracle's hit tokens. The largest ``k`` tried makes every window/state pool its working set,
    where nothing is evicted, so a ``k`` always exists; 0 for a model without window/state
    groups."""
    windows = [g for g in layout.groups if g.kind.value != "full"]
    if not windows:
        return 0
    hi = max(-(-(ws[g.name] - floor[g.name]) // tail_blocks(layout, g)) for g in windows)
    lo = 0
    unbounded = _unbounded_blocks(layout, convs)
    while lo < hi:
        k = (lo + hi) // 2
        pools = dict(unbounded)
        pools.update({n: b + 1 for n, b in _window_pools(layout, ws, floor, k).items()})
        model = ManagerModel(layout, pools, wl.max_num_seqs, wl.max_model_len)
        if simulate(wl, convs, model).hit_tokens == oracle_hits:
            hi = k
        else:
            lo = k + 1
    return lo


def split_pools(
    layout: CacheLayout,
    ws: Mapping[str, int],
    floor: Mapping[str, int],
    tails: int,
    memory: int,
) -> dict[str, int]:
    """kvforge's pools at ``memory`` bytes, split as its planner sizes a deployment.

    Each window/state group gets ``floor`` (:func:`floor_blocks`: the planner's reserve)
    plus a tail cache of ``tails * tail_blocks``
    blocks (``tails`` from :func:`tail_cache`), capped at its working set. The full groups
    share the remaining bytes in proportion to their working sets' bytes, whole blocks, never
    below their own ``floor``. Plus the null block per group. The caller gives the plain LRU
    the bytes of exactly these blocks (:func:`_memory_bytes`), so both get the same memory.
    """
    size = {g.name: int(layout.bytes_per_block(g.name)) for g in layout.groups}
    usable = _window_pools(layout, ws, floor, tails)
    rest = memory - sum(usable[n] * size[n] for n in usable)
    full = [g.name for g in layout.groups if g.kind.value == "full"]
    weight = sum(ws[n] * size[n] for n in full)
    for n in full:
        share = rest * ws[n] * size[n] // weight if weight else 0
        usable[n] = max(floor[n], share // size[n])
    return {g.name: usable[g.name] + 1 for g in layout.groups}


def _memory_bytes(
    layout: CacheLayout, num_blocks: Mapping[str, int], share_pools: bool = False
) -> int:
    # usable bytes; a shared pool's blocks are paid once, whichever group holds them
    groups = [s[0] for s in layout.pool_sets] if share_pools else list(num_blocks)
    return sum((num_blocks[g] - 1) * int(layout.bytes_per_block(g)) for g in groups)


def _history_only(layout: CacheLayout, hits: Sequence[int]) -> int:
    """Tokens an engine caching only the full groups serves, given the aligned hits: it must
    recompute the window tail every window/state group reads, ``max(W) - 1`` tokens, and
    serves nothing for a model without a full group."""
    if not any(g.kind.value == "full" for g in layout.groups):
        return 0
    windows = [int(g.window or 0) for g in layout.groups if g.kind.value != "full"]
    tail = max(windows) - 1 if windows else 0
    return sum(max(0, h - tail) for h in hits)


def _stream_keys(convs: Sequence[Conversation], unit: int) -> Callable[[int, int], object]:
    keys = [
        PrefixHasher(unit=unit).extend(
            c.tokens[: len(c.tokens) // unit * unit],
            at=np.arange(unit, len(c.tokens) + 1, unit),
        )
        for c in convs
    ]

    def key_at(conv: int, t: int) -> object:
        return keys[conv][t // unit - 1]

    return key_at


def measure_cost(
    layout: CacheLayout,
    prompt_len: int = 2048,
    repeats: int = 200,
    interleave: Callable[[], None] | None = None,
) -> tuple[float, float]:
    """Median microseconds of hashing a ``prompt_len``-token prompt (its keys at every unit
    end, ``BlockManager.prefix_unit``) and of ``BlockManager.lookup`` of it on a full hit
    (hashing, the key lookups and the exact check: ``lookup`` hashes the prompt itself).

    The prompt (seed 1, ids uniform in ``[0, 128000)``) was served and finished by a first
    request; the hit is every boundary below its last token, checked on every round.
    ``interleave``, if given, is called once per round (the warm-up round included) after
    kvforge's timings: the other side of a comparison, so that both see the same machine
    load round by round (``bench_prefix`` runs vLLM's rounds there)."""
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, 128_000, prompt_len, dtype=np.int64)
    num_blocks = {g.name: 2 + 2 * -(-prompt_len // g.block_size) for g in layout.groups}
    manager = BlockManager(layout, num_blocks, 2, prompt_len + 64, enable_prefix_caching=True)
    manager.end_step(manager.schedule(["first"], [prompt_len], new_token_ids=[tokens]))
    manager.finish(["first"])
    boundary = manager.boundary
    expected = (prompt_len - 1) // boundary * boundary
    unit = manager.prefix_unit
    at = np.arange(unit, prompt_len // unit * unit + 1, unit)
    clock = time.perf_counter_ns
    hash_ns: list[int] = []
    lookup_ns: list[int] = []
    query = [PrefixQuery(tokens)]
    gc.collect()
    gc.disable()
    try:
        for _ in range(repeats + 1):  # the first round warms up
            t0 = clock()
            PrefixHasher(unit=unit).extend(tokens, at=at)
            t1 = clock()
            match: PrefixMatch = manager.lookup(query)[0]
            t2 = clock()
            hash_ns.append(t1 - t0)
            lookup_ns.append(t2 - t1)
            if match.num_tokens != expected:
                raise AssertionError(f"a hit of {match.num_tokens} tokens, expected {expected}")
            if interleave is not None:
                interleave()
    finally:
        gc.enable()
    return statistics.median(hash_ns[1:]) / 1000.0, statistics.median(lookup_ns[1:]) / 1000.0


@dataclass
class PrefixRecord:
    """One row of the benchmark (``--json`` writes a list of these, as dicts)."""

    model: str
    fraction: str  # of the working set, e.g. "1/4"
    memory_bytes: int
    # kvforge's usable blocks per pool (null block excluded), a shared pool named by its
    # groups joined with "+" (gpt-oss: "swa+kv")
    pool_blocks: dict[str, int]
    tail_cache_tails: int  # tails each window/state pool caches beyond its floor
    hit_rate: float
    oracle_hit_rate: float
    token_oracle_hit_rate: float
    history_only_hit_rate: float
    lru_hit_rate: float
    evictions: dict[str, int]
    lru_evictions: dict[str, int]
    hash_us: float
    lookup_us: float
    run_lookup_us: float  # median BlockManager.lookup of this run's prompts
    vllm_hash_us: float | None
    vllm_lookup_us: float | None
    hash_lookup_ratio: float | None  # lookup_us / (vllm_hash_us + vllm_lookup_us)
    prompt_tokens: int
    hit_tokens: int
    oracle_tokens: int
    token_oracle_tokens: int
    lru_tokens: int
    preemptions: int
    lru_preemptions: int


def run_prefix_bench(
    wl: PrefixWorkload,
    models: Sequence[str] = tuple(MODELS),
    fractions: Mapping[str, Sequence[Fraction]] | None = None,
    cost_repeats: int = 200,
    vllm_cost: Callable[[int, int], tuple[float, float]] | None = None,
    progress: Callable[[str], None] | None = None,
) -> list[PrefixRecord]:
    """Every run of every model: the aligned oracle, then one BlockManager run and one plain
    LRU run per memory fraction of the working set.

    Args:
        wl: the workload (the same conversations for every model).
        models: names of ``MODELS``.
        fractions: per model, the fractions of its working set (default
            :data:`DEFAULT_FRACTIONS` for every model).
        cost_repeats: rounds of the hashing / lookup cost measurement (0: not measured, 0.0).
        vllm_cost: ``(prompt_len, block_size) -> (hash_us, lookup_us)`` of vLLM; used for the
            models whose every group is full attention (one group, the layout vLLM's side
            measures); ``None``: vLLM figures are null.
        progress: called with a label before each run.
    """
    convs = make_conversations(wl)
    records = []
    for name in models:
        layout = build_layout(name)
        say = progress or (lambda _label: None)
        say(f"{name}: aligned oracle")
        oracle_model = ManagerModel(
            layout, _unbounded_blocks(layout, convs), wl.max_num_seqs, wl.max_model_len
        )
        oracle = simulate(wl, convs, oracle_model)
        ws = working_set(layout, wl, oracle_model.peak)
        floor = floor_blocks(layout, wl, oracle_model.live_peak)
        history = _history_only(layout, oracle.hits)
        say(f"{name}: tail cache")
        tails = tail_cache(layout, wl, convs, ws, floor, oracle.hit_tokens)
        if cost_repeats:
            hash_us, lookup_us = measure_cost(layout, 2048, cost_repeats)
        else:
            hash_us = lookup_us = 0.0
        vllm_hash = vllm_lookup = None
        if vllm_cost is not None and all(g.kind.value == "full" for g in layout.groups):
            vllm_hash, vllm_lookup = vllm_cost(2048, min(g.block_size for g in layout.groups))
        unit = math.gcd(*(g.block_size for g in layout.groups))
        key_at = _stream_keys(convs, unit)
        for fraction in (fractions or {}).get(name, DEFAULT_FRACTIONS):
            # M: the same fraction of every group's working set (never below what the running
            # requests hold); kvforge splits M as its planner would, the LRU gets its bytes
            target = _memory_bytes(layout, _pools(ws, fraction, floor))
            num_blocks = shared_pool_blocks(layout, split_pools(layout, ws, floor, tails, target))
            memory = _memory_bytes(layout, num_blocks, share_pools=True)
            say(f"{name}: {fraction} of the working set, BlockManager")
            run_model = ManagerModel(
                layout, num_blocks, wl.max_num_seqs, wl.max_model_len, share_pools=True
            )
            run = simulate(wl, convs, run_model)
            say(f"{name}: {fraction} of the working set, plain LRU")
            lru_model = LruModel(layout, memory, key_at)
            lru = simulate(wl, convs, lru_model)
            ratio = None
            if vllm_hash is not None and vllm_lookup is not None:
                ratio = lookup_us / (vllm_hash + vllm_lookup)
            records.append(
                PrefixRecord(
                    model=name,
                    fraction=str(fraction),
                    memory_bytes=memory,
                    pool_blocks={
                        "+".join(members): num_blocks[members[0]] - 1
                        for members in layout.pool_sets
                    },
                    tail_cache_tails=tails,
                    hit_rate=_rate(run.hit_tokens, run.prompt_tokens),
                    oracle_hit_rate=_rate(oracle.hit_tokens, oracle.prompt_tokens),
                    token_oracle_hit_rate=_rate(run.token_oracle_tokens, run.prompt_tokens),
                    history_only_hit_rate=_rate(history, oracle.prompt_tokens),
                    lru_hit_rate=_rate(lru.hit_tokens, lru.prompt_tokens),
                    evictions=run_model.evictions,
                    lru_evictions=dict(sorted(lru_model.evictions.items())),
                    hash_us=hash_us,
                    lookup_us=lookup_us,
                    run_lookup_us=(
                        statistics.median(run_model.lookup_ns) / 1000.0
                        if run_model.lookup_ns
                        else 0.0
                    ),
                    vllm_hash_us=vllm_hash,
                    vllm_lookup_us=vllm_lookup,
                    hash_lookup_ratio=ratio,
                    prompt_tokens=run.prompt_tokens,
                    hit_tokens=run.hit_tokens,
                    oracle_tokens=oracle.hit_tokens,
                    token_oracle_tokens=run.token_oracle_tokens,
                    lru_tokens=lru.hit_tokens,
                    preemptions=run.preemptions,
                    lru_preemptions=lru.preemptions,
                )
            )
    return records


def _rate(hits: int, total: int) -> float:
    return hits / total if total else 0.0


# --- output -------------------------------------------------------------------------------------


def print_prefix_table(records: Sequence[PrefixRecord], title: str, out: Any = None) -> None:
    """The records as one rich table."""
    from kvforge.cli.formatting import console, format_bytes, make_table

    out = out or console()
    table = make_table(
        title,
        (
            "model",
            "memory",
            "bytes",
            "hit",
            "aligned oracle",
            "token oracle",
            "hit/token",
            "plain LRU",
            "history-only",
            "evictions",
            "lookup us",
            "vLLM us",
        ),
        ("model", "evictions"),
    )
    for r in records:
        vllm = (
            "-"
            if r.vllm_hash_us is None or r.vllm_lookup_us is None
            else f"{r.vllm_hash_us + r.vllm_lookup_us:.1f}"
        )
        table.add_row(
            r.model,
            r.fraction,
            format_bytes(r.memory_bytes),
            f"{r.hit_rate:.4f}",
            f"{r.oracle_hit_rate:.4f}",
            f"{r.token_oracle_hit_rate:.4f}",
            f"{_rate(r.hit_tokens, r.token_oracle_tokens):.3f}",
            f"{r.lru_hit_rate:.4f}",
            f"{r.history_only_hit_rate:.4f}",
            ", ".join(f"{k} {v}" for k, v in r.evictions.items()) or "0",
            f"{r.lookup_us:.1f}",
            vllm,
        )
    out.print(table)


def write_prefix_json(records: Sequence[PrefixRecord], path: str | Path) -> None:
    Path(path).write_text(json.dumps([asdict(r) for r in records], indent=1) + "\n")
