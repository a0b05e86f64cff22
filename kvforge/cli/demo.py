"""``kvforge demo``: a small serving loop that exercises the whole cache lifecycle, verified.

The loop plays an inference engine's scheduler against a :class:`CacheController` whose device
pools are deliberately too small for the load (by default each group holds a third of the
blocks all requests would hold at once), so requests compete for blocks:

1. requests arrive over time (deterministic from the seed) with varied prompt and output lengths;
2. each step, swapped-out requests are swapped back in (oldest first) while their live window
   plus one token fits in the free blocks; new requests are admitted (prefill: allocate the
   prompt and write its entries) only while nothing is swapped out;
3. every running request decodes one token: ``allocate(rid, n + 1)`` and write position ``n``;
   when a pool runs dry (:class:`OutOfBlocksError`) the newest running request is preempted
   with ``swap_out`` (purpose ``"preempt"``), or dropped to be recomputed when the host pool is
   full too, and the allocation is retried;
4. a finished request is verified byte for byte with :func:`verify_request` before it is freed.

Entry contents come from :mod:`kvforge.verify`: every entry of every role holds bytes derived
from (request seed, layer, role, position), written through the controller's slot mappings,
so every check is exact. Requests are also verified right after every swap-in, and the run
ends by verifying what is still live (running requests, and swapped ones once swapped back in)
and freeing everything. ``DemoResult.entries_verified`` counts every entry check, so an entry
checked after a swap-in and again when its request finishes counts twice.

``DemoConfig.corrupt_after_step`` is a self-test: it flips one byte of one live entry so the
run must report a mismatch (the CLI then exits 1).
"""

from __future__ import annotations

import argparse
import math
import random
import sys
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, computed_field, model_validator

from kvforge.attn_backends.base import AttentionBackend
from kvforge.cli.args import build_backends, list_models
from kvforge.cli.demo_prefix import PrefixDemoResult, run_prefix_demo
from kvforge.cli.formatting import UsageError, check_output_path, write_text
from kvforge.controller import CacheController
from kvforge.core.layout import CacheLayout
from kvforge.errors import OutOfBlocksError
from kvforge.scheduler.block_manager import held_blocks
from kvforge.specs import CacheGroup, GroupKind
from kvforge.verify import (
    EntryCheck,
    read_entries,
    verify_request,
    write_entries,
    write_request,
)

__all__ = [
    "DEFAULT_MODEL",
    "DemoConfig",
    "DemoResult",
    "GroupUsage",
    "SelfTestOutOfRange",
    "VerifyCount",
    "cmd_demo",
    "print_summary",
    "run_demo",
]

DEFAULT_MODEL = "deepseek-v4-tiny"
"""Bundled scaled-down DeepSeek-V4-Flash-shaped config: ratios 0, 4, 128 and an MTP layer."""

_SEED_RANGE = 1 << 20
"""Per-request content seeds stay small so the content hash never overflows int64."""


class DemoConfig(BaseModel):
    """What :func:`run_demo` runs. Every field has a default; the defaults finish in seconds.

    Attributes:
        model: a bundled model name or a ``config.json`` path (ignored when :func:`run_demo`
            gets ``backends``; then it is only the description shown in the summary).
        device: ``"cpu"``, ``"cuda"``, ``"npu"`` or ``"auto"`` (best available).
        seed: makes the run repeatable: arrivals, lengths and contents derive from it.
        requests: how many requests arrive.
        prompt_len: inclusive range of prompt lengths in tokens (log-uniform: mostly short).
        output_len: inclusive range of generated tokens per request (log-uniform).
        arrival_gap: inclusive range of steps between two arrivals.
        device_memory: device cache budget in bytes; ``None`` derives one whose pools hold
            ``device_share`` of the blocks all requests would hold at once (per group: a full
            group's share of every token the requests reach, a window or state group's share
            of their live windows), so requests must compete for blocks.
        device_share: see ``device_memory``.
        host_memory: host cache budget in bytes; ``None`` sizes the host pools to hold every
            request swapped out at once.
        watermark: share of each device pool that admission and swap-in leave free. The
            default 0 takes any free block (growth then preempts often, which is the point).
        max_steps: stop after this many steps (then verify what is live); ``None`` runs until
            every request has finished.
        verify_on_swap_in: verify every request right after it is swapped back in.
        corrupt_after_step: self-test: once this many steps have run, flip one byte of one
            live entry (of a full-history group when the model has one, so it stays live until
            it is checked); the run must then report at least one mismatch. A step after the
            last one that ends with a request running (or after ``max_steps``) is refused:
            the self-test could not flip anything there.
        prefix_conversations: after the serving loop, run this many multi-turn conversations
            over a shared system prompt with the prefix cache on, and verify every reused
            byte (:mod:`kvforge.cli.demo_prefix`); 0 skips it.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str = DEFAULT_MODEL
    device: str = "auto"
    seed: int = 0
    requests: int = Field(default=14, ge=1, le=100_000)
    prompt_len: tuple[int, int] = (16, 600)
    output_len: tuple[int, int] = (8, 128)
    arrival_gap: tuple[int, int] = (0, 2)
    device_memory: int | None = Field(default=None, gt=0)
    device_share: float = Field(default=1 / 3, gt=0, le=1)
    host_memory: int | None = Field(default=None, gt=0)
    watermark: float = Field(default=0.0, ge=0, lt=1)
    max_steps: int | None = Field(default=None, ge=1)
    verify_on_swap_in: bool = True
    corrupt_after_step: int | None = Field(default=None, ge=1)
    prefix_conversations: int = Field(default=4, ge=0, le=1000)

    @model_validator(mode="after")
    def _ranges(self) -> DemoConfig:
        for name, least in (("prompt_len", 1), ("output_len", 1), ("arrival_gap", 0)):
            lo, hi = getattr(self, name)
            if lo < least or hi < lo:
                raise ValueError(
                    f"{name} must be an inclusive range (lo, hi) with {least} <= lo <= hi, "
                    f"got {(lo, hi)}"
                )
        if (
            self.corrupt_after_step is not None
            and self.max_steps is not None
            and self.corrupt_after_step > self.max_steps
        ):
            raise ValueError(
                f"corrupt_after_step={self.corrupt_after_step} is after max_steps="
                f"{self.max_steps}: the run stops before it could flip a byte"
            )
        return self


class SelfTestOutOfRange(ValueError):
    """``corrupt_after_step`` named a step after the last one at which the run had a running
    request, so the self-test could not flip a byte (and the run would pass, silently)."""

    def __init__(self, step: int, steps: int, last_live: int) -> None:
        self.step, self.steps, self.last_live = step, steps, last_live
        super().__init__(self.describe(f"corrupt_after_step={step}"))

    def describe(self, what: str) -> str:
        """The message, with ``what`` naming the value (the field, or the CLI flag)."""
        return (
            f"{what} is past the run: it ran {self.steps} steps and step {self.last_live} was "
            f"the last with a running request whose bytes could be flipped; give a step from "
            f"1 to {self.last_live}"
        )


class GroupUsage(BaseModel):
    """Block use of one group over the run."""

    group: str
    kind: str
    block_size: int
    bytes_per_block: int
    usable_blocks: int
    peak_used_blocks: int
    host_usable_pages: int
    """0 when the group has nothing to offload."""
    host_peak_used_pages: int


class VerifyCount(BaseModel):
    """Entries checked at one kind of checkpoint, and how many differed."""

    entries: int = 0
    mismatched: int = 0

    def add(self, check: EntryCheck) -> None:
        self.entries += check.entries
        self.mismatched += check.mismatched


class DemoResult(BaseModel):
    """Everything a demo run measured. ``counts()`` leaves out the timings."""

    model: str
    device: str
    seed: int
    requests_total: int
    requests_finished: int
    steps: int
    tokens_generated: int
    """Decode tokens written (one per running request per step)."""
    prompt_tokens_written: int
    """Prefill positions written, re-prefills of recomputed requests included."""
    preemptions: int
    """Swap outs (purpose ``preempt``)."""
    swap_ins: int
    most_swapped: int
    """The most requests swapped out at the same time."""
    recomputes: int
    """Preemptions that dropped a request to recompute it later (host pool full)."""
    bytes_swapped_out: int
    bytes_swapped_in: int
    swap_out_seconds: float
    swap_in_seconds: float
    wall_seconds: float
    device_memory_budget: int
    device_cache_bytes: int
    host_cache_bytes: int
    device_share: float
    """Share of the requests' combined peak block demand the device pools hold, per group."""
    longest_request: int
    """Tokens the longest request reaches."""
    groups: list[GroupUsage]
    verify_finished: VerifyCount
    """Requests verified when they finished (or before a recompute dropped them)."""
    verify_swap_in: VerifyCount
    """Requests verified right after each swap-in."""
    verify_end: VerifyCount
    """Requests still live when the run stopped."""
    running_at_end: int
    """Requests running when the run stopped (``max_steps``), verified then freed."""
    swapped_at_end: int
    """Requests swapped out when the run stopped, swapped back in, verified, then freed."""
    unverified_requests: int
    """Requests holding entries that could not be checked (0 unless something went wrong)."""
    corrupted: bool
    """The self-test flipped a byte."""
    prefix: PrefixDemoResult | None = None
    """The prefix-reuse phase (``None`` when skipped)."""

    @computed_field  # type: ignore[prop-decorator]
    @property
    def entries_verified(self) -> int:
        prefix = self.prefix.entries_verified if self.prefix else 0
        return (
            self.verify_finished.entries
            + self.verify_swap_in.entries
            + self.verify_end.entries
            + prefix
        )

    @computed_field  # type: ignore[prop-decorator]
    @property
    def entries_mismatched(self) -> int:
        return (
            self.verify_finished.mismatched
            + self.verify_swap_in.mismatched
            + self.verify_end.mismatched
            + (self.prefix.entries_mismatched if self.prefix else 0)
        )

    @computed_field  # type: ignore[prop-decorator]
    @property
    def ok(self) -> bool:
        """True when every checked entry matched and nothing was left unchecked."""
        return self.entries_mismatched == 0 and self.unverified_requests == 0

    @staticmethod
    def _gbps(nbytes: int, seconds: float) -> float | None:
        return nbytes / seconds / 1e9 if seconds > 0 else None

    @computed_field  # type: ignore[prop-decorator]
    @property
    def swap_out_gbps(self) -> float | None:
        """Bytes swapped out per second spent in ``swap_out`` (GB/s)."""
        return self._gbps(self.bytes_swapped_out, self.swap_out_seconds)

    @computed_field  # type: ignore[prop-decorator]
    @property
    def swap_in_gbps(self) -> float | None:
        """Bytes swapped in per second spent in ``swap_in`` (GB/s)."""
        return self._gbps(self.bytes_swapped_in, self.swap_in_seconds)

    def counts(self) -> dict[str, Any]:
        """Everything except timings: equal for two runs with the same config."""
        timings = {"swap_out_seconds", "swap_in_seconds", "wall_seconds"}
        return self.model_dump(exclude=timings | {"swap_out_gbps", "swap_in_gbps"})

    def summary_line(self) -> str:
        """The last line the CLI prints."""
        return f"verified {self.entries_verified} entries, {self.entries_mismatched} mismatched"


# ---------------------------------------------------------------------------------- sizing


def _live_blocks(group: CacheGroup, num_tokens: int) -> int:
    """Blocks a request of ``num_tokens`` tokens holds in ``group`` between steps."""
    return held_blocks(group, num_tokens, num_tokens)


#: Prompts are prefilled in chunks of this many tokens, one step each, as engines do (small,
#: so a window group's prefill allowance stays small next to the full groups it competes with).
PREFILL_CHUNK = 16


def _prefill_peak(group: CacheGroup, prompt_len: int) -> int:
    """The most blocks a request holds in ``group`` while its prompt is prefilled in chunks:
    a window group holds a block for every token of the current chunk, plus its window."""
    return max(
        held_blocks(group, start, min(prompt_len, start + PREFILL_CHUNK))
        for start in range(0, prompt_len, PREFILL_CHUNK)
    )


def _peak_blocks(group: CacheGroup, prompt_len: int, final_len: int) -> int:
    """The most blocks a request holds in ``group``: its prefill peak, then its live window
    as it decodes."""
    return max(_prefill_peak(group, prompt_len), group.max_live_blocks(final_len))


@dataclass
class _Sizing:
    budget: int
    """The budget given, or the one derived."""
    share: float
    """Share of the requests' combined peak demand the pools hold, per group."""
    blocks: dict[str, int]
    """Physical blocks per group (null block included)."""
    longest: int
    """Tokens the longest request reaches."""


def _size_device(
    layout: CacheLayout, lengths: list[tuple[int, int]], budget: int | None, share: float
) -> _Sizing:
    """Device blocks per group: ``share`` of what every request would hold at once.

    The demand of a group is the sum over requests of the most blocks each holds in it while
    it grows to its final length (a full group: all its blocks; a window or state group: its
    live window). Each group gets ``ceil(share * demand)`` blocks, and never fewer than the
    longest request needs alone. Sizing every group by the same share (rather than reserving
    window and state blocks for a fixed ``max_num_seqs``) lets every group run dry, so
    preemption is driven by growth in any of them. With a ``budget``, ``share`` is the largest
    that fits it.

    Raises:
        ValueError: the budget cannot hold the longest request alone (says what would).
    """
    from kvforge.cli.formatting import format_bytes

    longest = max(final for _, final in lengths)
    groups = [(g.name, layout.bytes_per_block(g.name)) for g in layout.groups]
    # Between steps a request holds its live window; during its prefill step a window group
    # also holds the prompt's other blocks, until its first decode step. Demand is the
    # steady state of every request plus one prefill allowance (the largest), as a memory
    # plan budgets one batch-wide allowance rather than one per request.
    steady = {g.name: [g.max_live_blocks(f) for _, f in lengths] for g in layout.groups}
    peaks = {g.name: [_peak_blocks(g, p, f) for p, f in lengths] for g in layout.groups}
    demand = {
        name: sum(steady[name])
        + max(pk - st for pk, st in zip(peaks[name], steady[name], strict=True))
        for name in peaks
    }
    alone = {name: max(counts) for name, counts in peaks.items()}

    def blocks_for(f: float) -> dict[str, int]:
        return {name: max(alone[name], math.ceil(f * demand[name])) + 1 for name, _ in groups}

    def cost(f: float) -> int:
        blocks = blocks_for(f)
        return sum(blocks[name] * bpb for name, bpb in groups)

    if budget is None:
        return _Sizing(cost(share), share, blocks_for(share), longest)
    least = cost(0.0)
    if budget < least:
        short = ", ".join(f"{name}: {alone[name]} blocks" for name, _ in groups)
        raise ValueError(
            f"device memory {format_bytes(budget)} cannot hold even one request alone: the "
            f"longest request reaches {longest} tokens and needs {short}; raise "
            f"--device-memory to at least {format_bytes(least)} ({least} bytes)"
        )
    lo, hi = 0.0, 1.0
    if cost(hi) <= budget:
        lo = hi  # everything fits at once: more blocks would never be used
    for _ in range(40):
        if hi - lo < 1e-6:
            break
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if cost(mid) <= budget else (lo, mid)
    return _Sizing(budget, lo, blocks_for(lo), longest)


def _size_host(
    layout: CacheLayout, max_len: int, requests: int, budget: int | None
) -> dict[str, int]:
    """Host pages per group: room for ``requests`` swapped requests, or what ``budget`` holds."""
    from kvforge.cli.formatting import format_bytes

    need = {g.name: g.max_live_blocks(max_len) for g in layout.groups}
    page = {g.name: layout.host_page_bytes(g.name) for g in layout.groups}
    per_request = sum(need[n] * page[n] for n in need)
    held = requests
    if budget is not None:
        null_pages = sum(page.values())
        held = (budget - null_pages) // per_request if per_request else requests
        if held < 1:
            raise ValueError(
                f"host memory {format_bytes(budget)} cannot hold one preempted request (the "
                f"longest needs {format_bytes(per_request)} of host pages plus "
                f"{format_bytes(null_pages)} of reserved pages); raise --host-memory to at "
                f"least {format_bytes(per_request + null_pages)}"
            )
    return {n: max(2, held * need[n] + 1) for n in need}


# ---------------------------------------------------------------------------------- the loop


@dataclass
class _Request:
    index: int
    rid: str
    seed: int
    arrival: int
    prompt_len: int
    output_len: int
    generated: int = 0
    state: Literal["pending", "waiting", "running", "swapped", "finished"] = "pending"

    @property
    def context(self) -> int:
        """Tokens the request holds (prompt plus generated)."""
        return self.prompt_len + self.generated


def _log_uniform(rng: random.Random, lo: int, hi: int) -> int:
    """An int in ``[lo, hi]`` whose log is uniform: mostly short, a few long, like real traffic."""
    return min(hi, max(lo, round(math.exp(rng.uniform(math.log(lo), math.log(hi))))))


def _make_requests(config: DemoConfig) -> list[_Request]:
    rng = random.Random(config.seed)
    out: list[_Request] = []
    clock = 0
    width = len(str(config.requests - 1))
    for i in range(config.requests):
        clock += rng.randint(*config.arrival_gap)
        out.append(
            _Request(
                index=i,
                rid=f"req-{i:0{width}d}",
                seed=rng.randrange(_SEED_RANGE),
                arrival=clock,
                prompt_len=_log_uniform(rng, *config.prompt_len),
                output_len=_log_uniform(rng, *config.output_len),
            )
        )
    return out


@contextmanager
def _cpu_threads(device: torch.device) -> Iterator[None]:
    """One intra-op thread on CPU: the loop does many tiny tensor ops, which threads slow down."""
    if device.type != "cpu":
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


class _Loop:
    """State of one demo run (see the module docstring for the policy)."""

    def __init__(self, ctl: CacheController, config: DemoConfig, requests: list[_Request]):
        self.ctl = ctl
        self.config = config
        self.requests = requests
        self.groups = list(ctl.layout.groups)
        self.pending = list(requests)  # not arrived yet, in arrival order
        self.waiting: list[_Request] = []
        self.running: list[_Request] = []
        self.swapped: list[_Request] = []
        self.peak = dict.fromkeys(ctl.groups, 0)
        self.host_peak = dict.fromkeys(ctl.groups, 0)
        self.verify_finished = VerifyCount()
        self.verify_swap_in = VerifyCount()
        self.verify_end = VerifyCount()
        self.unverified = 0
        self.tokens_generated = 0
        self.prompt_tokens = 0
        self.preemptions = 0
        self.swap_ins = 0
        self.recomputes = 0
        self.bytes_out = 0
        self.bytes_in = 0
        self.seconds_out = 0.0
        self.seconds_in = 0.0
        self.corrupted = False
        self.steps = 0
        self.clock = 0
        self.idle = 0
        self.most_swapped = 0
        self.last_live_step = 0  # the last step that ended with a request running
        self.running_at_end = 0
        self.swapped_at_end = 0
        self.ratios = {g: ctl.layout.compress_ratios(g) for g in ctl.groups}
        self.watermark = {
            g: math.ceil(config.watermark * ctl.num_usable_blocks(g)) for g in ctl.groups
        }

    # ------------------------------------------------------------------ bookkeeping

    def _sample_device(self) -> None:
        for g in self.peak:
            self.peak[g] = max(self.peak[g], self.ctl.num_used_blocks(g))

    def _sample_host(self) -> None:
        for g, (used, _) in self.ctl.host_pool_usage().items():
            self.host_peak[g] = max(self.host_peak[g], used)

    def _next_step_need(self) -> dict[str, int]:
        """Blocks the running requests need, per group, to decode their next token."""
        need = dict.fromkeys(self.peak, 0)
        for r in self.running:
            n = r.context
            for g in self.groups:
                need[g.name] += max(0, _live_blocks(g, n + 1) - _live_blocks(g, n))
        return need

    def _fits(self, num_tokens: int, reserve: bool = False, prefill: bool = False) -> bool:
        """Whether a request of ``num_tokens`` tokens fits now, above the watermark.

        Like vLLM's block manager: admission and swap-in only look at free blocks (keeping the
        watermark free, none by default); the growth of running requests is left to preemption.
        """
        keep = dict(self.watermark)
        if reserve:
            for g, n in self._next_step_need().items():
                keep[g] += n
        return all(
            self.ctl.num_free_blocks(g.name)
            - (_prefill_peak(g, num_tokens) if prefill else _live_blocks(g, num_tokens))
            >= keep[g.name]
            for g in self.groups
        )

    # ------------------------------------------------------------------ phases

    def arrive(self, clock: int) -> None:
        while self.pending and self.pending[0].arrival <= clock:
            r = self.pending.pop(0)
            r.state = "waiting"
            self.waiting.append(r)

    def _swap_in(self, r: _Request) -> bool:
        """Swap ``r`` in (timed). Returns False when the device pools lack blocks."""
        start = time.perf_counter()
        try:
            handle = self.ctl.swap_in(r.rid)
        except OutOfBlocksError:
            return False
        handle.wait()
        self.seconds_in += time.perf_counter() - start
        self.bytes_in += handle.bytes_moved
        self.swap_ins += 1
        self.swapped.remove(r)
        self._sample_device()
        return True

    def swap_in_ready(self) -> int:
        """Swap in swapped requests, oldest first, while they fit. Returns how many."""
        done = 0
        while self.swapped:
            r = min(self.swapped, key=lambda q: q.index)
            if self.running and not self._fits(r.context + 1, reserve=True):
                break
            if not self._swap_in(r):
                break
            done += 1
            r.state = "running"
            self.running.append(r)
            if self.config.verify_on_swap_in:
                self.verify_swap_in.add(verify_request(self.ctl, r.rid, r.seed))
        return done

    def admit(self) -> int:
        """Prefill waiting requests, first come first served, while they fit. Returns how many."""
        done = 0
        while self.waiting and not self.swapped:
            r = self.waiting[0]
            if self.running and not self._fits(r.context + 1, prefill=True):
                break
            try:
                for end in range(PREFILL_CHUNK, r.context + PREFILL_CHUNK, PREFILL_CHUNK):
                    self.ctl.allocate(r.rid, min(end, r.context))
            except OutOfBlocksError:
                if r.rid in self.ctl.requests:  # a chunk did not fit: give the others back
                    self.ctl.free_request(r.rid)
                break
            self.waiting.pop(0)
            write_request(self.ctl, r.rid, r.seed, range(r.context))
            self.prompt_tokens += r.context
            r.state = "running"
            self.running.append(r)
            self._sample_device()
            done += 1
        return done

    def preempt(self, victim: _Request) -> None:
        """Swap ``victim`` out; when the host pool is full, drop it to be recomputed."""
        start = time.perf_counter()
        try:
            handle = self.ctl.swap_out(victim.rid, "preempt")
        except OutOfBlocksError:
            # Recompute preemption: check what it holds, then start it over from its prompt
            # plus what it generated so far (re-prefilled on admission).
            self.verify_finished.add(verify_request(self.ctl, victim.rid, victim.seed))
            self.ctl.free_request(victim.rid)
            self.running.remove(victim)
            victim.state = "waiting"
            self.waiting.append(victim)
            self.waiting.sort(key=lambda q: q.index)
            self.recomputes += 1
            return
        handle.wait()
        self.seconds_out += time.perf_counter() - start
        self.bytes_out += handle.bytes_moved
        self.preemptions += 1
        self.running.remove(victim)
        victim.state = "swapped"
        self.swapped.append(victim)
        self.most_swapped = max(self.most_swapped, len(self.swapped))
        self._sample_host()

    def decode(self) -> int:
        """Grow every running request by one token. Returns the tokens generated."""
        generated = 0
        for r in sorted(self.running, key=lambda q: q.index):
            while r.state == "running":
                try:
                    self.ctl.allocate(r.rid, r.context + 1)
                    break
                except OutOfBlocksError:
                    self.preempt(max(self.running, key=lambda q: q.index))
            if r.state != "running":
                continue
            self._sample_device()
            n = r.context
            # Only groups with a role that completes an entry at position n (a role with
            # compress ratio k writes at positions k-1, 2k-1, ...): the others would write
            # nothing, and skipping them saves their slot mappings.
            groups = [g for g, ks in self.ratios.items() if any(n % k == k - 1 for k in ks)]
            write_request(self.ctl, r.rid, r.seed, [n], groups=groups)
            r.generated += 1
            generated += 1
            if r.generated == r.output_len:
                self.verify_finished.add(verify_request(self.ctl, r.rid, r.seed))
                self.ctl.free_request(r.rid)
                self.running.remove(r)
                r.state = "finished"
        self.tokens_generated += generated
        return generated

    @property
    def busy(self) -> bool:
        """Whether any request has not finished yet."""
        return bool(self.pending or self.waiting or self.running or self.swapped)

    def step(self) -> int:
        """One scheduler step: arrivals, swap-ins, admissions, one decode token each.

        Returns:
            the tokens generated.
        """
        if not (self.waiting or self.running or self.swapped):
            self.clock = self.pending[0].arrival  # nothing to do until the next arrival
        self.arrive(self.clock)
        moved = self.swap_in_ready() + self.admit()
        generated = self.decode()
        self.steps += 1
        self.clock += 1
        self.idle = 0 if moved or generated else self.idle + 1
        if self.idle > 2:  # pragma: no cover - the fit checks make this unreachable
            raise RuntimeError("the demo loop made no progress; this is a bug in kvforge")
        return generated

    def corrupt(self) -> bool:
        """Self-test: flip one byte of one live entry. Returns whether it found one."""
        fulls = [e for e in self.ctl.layout.buffers if e.group.kind is GroupKind.FULL]
        entries = fulls or list(self.ctl.layout.buffers)
        for r in sorted(self.running, key=lambda q: q.index):
            for e in entries:
                positions = range(r.context) if fulls else [r.context - 1]
                slots = self.ctl.slot_mapping(
                    r.rid, e.group.name, list(positions), e.role.compress_ratio
                )
                live = slots[slots >= 0]
                if len(live):
                    cache = self.ctl.kv_caches[e.index]
                    slot = live[:1]
                    entry = read_entries(cache, e, slot)
                    entry[0, 0] ^= 0xFF  # flip one byte, through the declared layout
                    write_entries(cache, e, slot, entry)
                    return True
        return False

    def finish(self) -> None:
        """Verify everything still live (swapped requests once swapped back in), free it."""
        self.running_at_end, self.swapped_at_end = len(self.running), len(self.swapped)
        for r in sorted(self.running, key=lambda q: q.index):
            self.verify_end.add(verify_request(self.ctl, r.rid, r.seed))
            self.ctl.free_request(r.rid)
        self.running.clear()
        for r in sorted(self.swapped, key=lambda q: q.index):
            # The pools are empty now and every request fits alone (checked when sizing).
            if self._swap_in(r):
                self.verify_end.add(verify_request(self.ctl, r.rid, r.seed))
            else:  # pragma: no cover - unreachable after the sizing checks
                self.unverified += 1
                self.swapped.remove(r)
            self.ctl.free_request(r.rid)


def _warm_up(ctl: CacheController) -> None:
    """One untimed swap round trip, so one-time kernel set-up (JIT compiles, cache loads,
    lazy imports) does not count as swap time. Leaves the pools as they were."""
    rid = "kvforge-demo-warm-up"
    ctl.allocate(rid, 1)
    ctl.swap_out(rid, "preempt").wait()
    ctl.swap_in(rid).wait()
    ctl.free_request(rid)


def run_demo(
    config: DemoConfig | None = None,
    progress: bool = True,
    backends: Mapping[int, AttentionBackend] | None = None,
) -> DemoResult:
    """Run the demo serving loop and return what it measured.

    Args:
        config: what to run (defaults: :class:`DemoConfig`).
        progress: show a progress bar on stderr.
        backends: layer id -> backend; default: load ``config.model``.

    Raises:
        ValueError: a budget too small for one request alone (the message says how much is
            needed), an unknown model, an unavailable device.
        SelfTestOutOfRange: ``corrupt_after_step`` is past the last step with a running
            request (a ``ValueError``; the message gives the steps that work).
    """
    config = config or DemoConfig()
    start = time.perf_counter()
    if backends is None:
        from kvforge.models.hf_config import from_hf_config, load_model_config

        backends = from_hf_config(load_model_config(config.model))
    ctl = CacheController(backends, device=config.device)
    try:
        with _cpu_threads(ctl.device):
            result = _run(ctl, config, progress, start)
            if config.prefix_conversations:
                prefix = run_prefix_demo(
                    backends, config.prefix_conversations, config.seed, str(ctl.device)
                )
                result = result.model_copy(update={"prefix": prefix})
            return result
    finally:
        ctl.free()


def _run(ctl: CacheController, config: DemoConfig, progress: bool, start: float) -> DemoResult:
    requests = _make_requests(config)
    lengths = [(r.prompt_len, r.prompt_len + r.output_len) for r in requests]
    sizing = _size_device(ctl.layout, lengths, config.device_memory, config.device_share)
    host_pages = _size_host(ctl.layout, sizing.longest, len(requests), config.host_memory)
    ctl.initialize_kv_cache(num_blocks=sizing.blocks)
    ctl.initialize_host_cache(num_pages=host_pages)
    device_bytes, host_bytes = ctl.device_bytes, ctl.host_bytes
    _warm_up(ctl)
    loop = _Loop(ctl, config, requests)

    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    bar = Progress(
        TextColumn("[progress.description]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("tokens"),
        console=Console(stderr=True),
        disable=not progress,
        transient=True,
    )
    with bar:
        task = bar.add_task("demo", total=sum(r.output_len for r in requests))
        while loop.busy:
            if config.max_steps is not None and loop.steps >= config.max_steps:
                break
            generated = loop.step()
            if loop.running:
                loop.last_live_step = loop.steps
            if (
                config.corrupt_after_step is not None
                and not loop.corrupted
                and loop.steps >= config.corrupt_after_step
            ):
                loop.corrupted = loop.corrupt()
            bar.update(
                task,
                advance=generated,
                description=(
                    f"step {loop.steps}: {len(loop.running)} running, {len(loop.swapped)} swapped"
                ),
            )
    loop.finish()
    if config.corrupt_after_step is not None and not loop.corrupted:
        raise SelfTestOutOfRange(config.corrupt_after_step, loop.steps, loop.last_live_step)
    usage = ctl.host_pool_usage()
    host_usable = {g: usable for g, (_, usable) in usage.items()}
    groups = [
        GroupUsage(
            group=g.name,
            kind=g.kind.value,
            block_size=g.block_size,
            bytes_per_block=ctl.bytes_per_block(g.name),
            usable_blocks=ctl.num_usable_blocks(g.name),
            peak_used_blocks=loop.peak[g.name],
            host_usable_pages=host_usable.get(g.name, 0),
            host_peak_used_pages=loop.host_peak[g.name],
        )
        for g in ctl.layout.groups
    ]
    ctl.platform.synchronize()
    ctl.free()
    return DemoResult(
        model=config.model,
        device=str(ctl.device),
        seed=config.seed,
        requests_total=len(requests),
        requests_finished=sum(r.state == "finished" for r in requests),
        steps=loop.steps,
        tokens_generated=loop.tokens_generated,
        prompt_tokens_written=loop.prompt_tokens,
        preemptions=loop.preemptions,
        swap_ins=loop.swap_ins,
        most_swapped=loop.most_swapped,
        recomputes=loop.recomputes,
        bytes_swapped_out=loop.bytes_out,
        bytes_swapped_in=loop.bytes_in,
        swap_out_seconds=loop.seconds_out,
        swap_in_seconds=loop.seconds_in,
        wall_seconds=time.perf_counter() - start,
        device_memory_budget=sizing.budget,
        device_cache_bytes=device_bytes,
        host_cache_bytes=host_bytes,
        device_share=sizing.share,
        longest_request=sizing.longest,
        groups=groups,
        verify_finished=loop.verify_finished,
        verify_swap_in=loop.verify_swap_in,
        verify_end=loop.verify_end,
        running_at_end=loop.running_at_end,
        swapped_at_end=loop.swapped_at_end,
        unverified_requests=loop.unverified,
        corrupted=loop.corrupted,
    )


# ---------------------------------------------------------------------------------- summary


def print_summary(result: DemoResult, out: Any = None) -> None:
    """Print ``result`` as rich tables; the very last line is ``verified N entries, M mismatched``.

    Args:
        result: what :func:`run_demo` returned.
        out: a rich ``Console`` (default: :func:`kvforge.cli.formatting.console`).
    """
    from rich.table import Table

    from kvforge.cli.formatting import console, format_bytes

    out = out or console()

    def rate(gbps: float | None) -> str:
        return f"{gbps:.2f} GB/s" if gbps is not None else "-"

    run = Table(title=f"kvforge demo: {result.model} on {result.device}", show_header=False)
    run.add_column("what")
    run.add_column("value", justify="right")
    rows = [
        ("requests finished / total", f"{result.requests_finished} / {result.requests_total}"),
        ("seed", str(result.seed)),
        ("steps", f"{result.steps:,}"),
        ("tokens generated (decode)", f"{result.tokens_generated:,}"),
        ("prompt tokens written (prefill)", f"{result.prompt_tokens_written:,}"),
        ("preemptions (swap outs)", f"{result.preemptions:,}"),
        ("swap ins", f"{result.swap_ins:,}"),
        ("most requests swapped out at once", f"{result.most_swapped:,}"),
        ("recomputes (host pool full)", f"{result.recomputes:,}"),
        ("bytes swapped out", format_bytes(result.bytes_swapped_out)),
        ("bytes swapped in", format_bytes(result.bytes_swapped_in)),
        ("swap-out throughput", rate(result.swap_out_gbps)),
        ("swap-in throughput", rate(result.swap_in_gbps)),
        (
            "device cache (budget)",
            f"{format_bytes(result.device_cache_bytes)} "
            f"({format_bytes(result.device_memory_budget)})",
        ),
        ("device pools hold (share of peak demand)", f"{result.device_share:.0%}"),
        ("longest request", f"{result.longest_request:,} tokens"),
        ("host cache", format_bytes(result.host_cache_bytes)),
        ("wall time", f"{result.wall_seconds:.2f} s"),
    ]
    for what, value in rows:
        run.add_row(what, value)
    out.print(run)

    groups = Table(title="blocks per group (peak used / usable)")
    for col in ("group", "kind", "block size", "device peak", "device usable", "use", "host peak"):
        groups.add_column(col, justify="left" if col in ("group", "kind") else "right")
    for g in result.groups:
        use = f"{100 * g.peak_used_blocks // max(1, g.usable_blocks)}%"
        host = f"{g.host_peak_used_pages} / {g.host_usable_pages}" if g.host_usable_pages else "-"
        groups.add_row(
            g.group,
            g.kind,
            str(g.block_size),
            f"{g.peak_used_blocks:,}",
            f"{g.usable_blocks:,}",
            use,
            host,
        )
    out.print(groups)

    checks = Table(title="byte-for-byte verification")
    for col in ("checkpoint", "entries", "mismatched"):
        checks.add_column(col, justify="left" if col == "checkpoint" else "right")
    for what, count in (
        ("finished requests (before free)", result.verify_finished),
        ("after each swap-in", result.verify_swap_in),
        (
            f"still live at the end ({result.running_at_end} running, "
            f"{result.swapped_at_end} swapped)",
            result.verify_end,
        ),
    ):
        checks.add_row(what, f"{count.entries:,}", f"{count.mismatched:,}")
    out.print(checks)
    if result.prefix is not None:
        p = result.prefix
        reuse = Table(title="prefix reuse (multi-turn, shared system prompt)", show_header=False)
        reuse.add_column("what")
        reuse.add_column("value", justify="right")
        for what, value in (
            ("conversations / turns", f"{p.conversations} / {p.turns}"),
            ("prompt tokens", f"{p.prompt_tokens:,}"),
            ("served from cache", f"{p.hit_tokens:,} ({p.hit_rate:.1%})"),
            ("reuse boundary (LCM of block sizes)", f"{p.boundary} tokens"),
            ("entries verified (reused included)", f"{p.entries_verified:,}"),
            ("mismatched", f"{p.entries_mismatched:,}"),
        ):
            reuse.add_row(what, value)
        out.print(reuse)
    if result.corrupted:
        out.print("self-test: one byte of one live entry was flipped on purpose")
    if result.unverified_requests:
        out.print(f"{result.unverified_requests} requests could not be verified")
    out.print(result.summary_line(), markup=False, highlight=False, soft_wrap=True)


# ---------------------------------------------------------------------------------- command


def cmd_demo(args: argparse.Namespace) -> int:
    """``kvforge demo``: the serving loop; exit 1 on a mismatch (the self-test's included)."""
    if args.list_models:
        return list_models(args)
    if args.json is not None:
        check_output_path(args.json, "--json")
    if not (args.model or args.config or args.backend):
        args.model = DEFAULT_MODEL
    description, backends = build_backends(args)
    config = DemoConfig(
        model=description,
        device=args.device,
        seed=args.seed,
        requests=args.requests,
        device_memory=args.device_memory,
        host_memory=args.host_memory,
        corrupt_after_step=args.self_test_corrupt,
        prefix_conversations=args.prefix_conversations,
    )
    progress = not args.no_progress and sys.stderr.isatty()
    try:
        result = run_demo(config, progress=progress, backends=backends)
    except SelfTestOutOfRange as exc:
        raise UsageError(exc.describe(f"--self-test-corrupt {exc.step}")) from None
    if args.json is not None:
        write_text(args.json, result.model_dump_json(indent=2) + "\n")
    print_summary(result)
    return 0 if result.ok else 1
