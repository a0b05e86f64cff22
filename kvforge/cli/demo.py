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

The device pools are sized in integers through the memory planner
(:mod:`kvforge.cli.demo_sizing`); results and their tables are :mod:`kvforge.cli.demo_report`
(re-exported here); :func:`cmd_demo` is ``kvforge demo``.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import random
import sys
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from kvforge.attn_backends.base import AttentionBackend
from kvforge.cli.args import build_backends, list_models
from kvforge.cli.demo_prefix import (
    REMOTE_TIERS,
    StoreUnavailable,
    run_prefix_demo,
    store_server,
)
from kvforge.cli.demo_report import DemoResult, GroupUsage, VerifyCount, print_summary
from kvforge.cli.demo_sizing import (
    PREFILL_CHUNK,
    DeviceSizing,
    live_blocks,
    prefill_peak,
    size_device,
    size_host,
)
from kvforge.cli.formatting import UsageError, check_output_path, write_text
from kvforge.cli.remotes import given_addresses
from kvforge.controller import CacheController
from kvforge.core.memory_plan import shared_pool_blocks
from kvforge.errors import OutOfBlocksError
from kvforge.specs import GroupKind
from kvforge.verify import (
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
        tier: where that phase keeps cached prefixes: ``"device"``, ``"host"`` (a device
            of about one conversation with a host tier behind it), or ``"redis"`` /
            ``"mooncake"`` (that and a remote tier: engine A publishes, a second controller,
            engine B, reuses; :mod:`kvforge.cli.demo_prefix`).
        store_address: the remote tier's server (``HOST:PORT``); ``None`` starts one for the
            run and stops it after.
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
    tier: Literal["device", "host", "redis", "mooncake"] = "device"
    store_address: str | None = None

    @model_validator(mode="after")
    def _ranges(self) -> DemoConfig:
        for name, least in (("prompt_len", 1), ("output_len", 1), ("arrival_gap", 0)):
            lo, hi = getattr(self, name)
            if lo < least or hi < lo:
                raise ValueError(
                    f"{name} must be an inclusive range (lo, hi) with {least} <= lo <= hi, "
                    f"got {(lo, hi)}"
                )
        if self.store_address is not None and self.tier not in REMOTE_TIERS:
            raise ValueError(f"store_address applies to a remote tier, not tier={self.tier!r}")
        if self.tier in REMOTE_TIERS and not self.prefix_conversations:
            raise ValueError(f"tier={self.tier!r} applies to the prefix-reuse phase, which is off")
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
            g: math.ceil(config.watermark * ctl.scheduler.num_usable_blocks(g)) for g in ctl.groups
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
                need[g.name] += max(0, live_blocks(g, n + 1) - live_blocks(g, n))
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
            - (prefill_peak(g, num_tokens) if prefill else live_blocks(g, num_tokens))
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
        from kvforge.models.hf_config import from_hf_config

        backends = from_hf_config(config.model)
    with contextlib.ExitStack() as stack:
        address, notes = None, ()
        if config.tier in REMOTE_TIERS:  # started first: a missing server fails fast
            address, said = stack.enter_context(store_server(config.tier, config.store_address))
            notes = tuple(said)
        ctl = CacheController(backends, device=config.device)
        try:
            with _cpu_threads(ctl.device):
                result = _run(ctl, config, progress, start)
                if config.prefix_conversations:
                    prefix = run_prefix_demo(
                        backends,
                        config.prefix_conversations,
                        config.seed,
                        str(ctl.device),
                        config.tier,
                        address,
                    )
                    if address is not None:
                        server = config.store_address or "started"
                        prefix = prefix.model_copy(update={"server": server, "notes": notes})
                    result = result.model_copy(update={"prefix": prefix})
                return result
        finally:
            ctl.free()
    raise AssertionError("unreachable")  # pragma: no cover


def _prepare(ctl: CacheController, config: DemoConfig) -> tuple[list[_Request], DeviceSizing]:
    """The requests, and the controller's pools sized for them (device and host), warmed up."""
    requests = _make_requests(config)
    lengths = [(r.prompt_len, r.prompt_len + r.output_len) for r in requests]
    sizing = size_device(ctl.layout, lengths, config.device_memory, config.device_share)
    host_pages = size_host(ctl.layout, sizing.longest, len(requests), config.host_memory)
    # groups whose pages pair up draw on one pool of all their blocks (the same bytes)
    ctl.initialize_kv_cache(num_blocks=shared_pool_blocks(ctl.layout, sizing.blocks))
    ctl.initialize_host_cache(num_pages=host_pages)
    return requests, sizing


def _serve(loop: _Loop, config: DemoConfig, total_tokens: int, progress: bool) -> None:
    """Step ``loop`` until it is idle (or ``max_steps``), flipping a byte on the self-test's
    step, with a progress bar on stderr."""
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
        task = bar.add_task("demo", total=total_tokens)
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


def _group_usage(ctl: CacheController, loop: _Loop) -> list[GroupUsage]:
    usage = ctl.host_pool_usage()
    host_usable = {g: usable for g, (_, usable) in usage.items()}
    return [
        GroupUsage(
            group=g.name,
            kind=g.kind.value,
            block_size=g.block_size,
            bytes_per_block=ctl.bytes_per_block(g.name),
            usable_blocks=ctl.scheduler.num_usable_blocks(g.name),
            peak_used_blocks=loop.peak[g.name],
            host_usable_pages=host_usable.get(g.name, 0),
            host_peak_used_pages=loop.host_peak[g.name],
        )
        for g in ctl.layout.groups
    ]


def _loop_counts(loop: _Loop) -> dict[str, Any]:
    """What the serving loop counted, as :class:`DemoResult` fields."""
    return dict(
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
        verify_finished=loop.verify_finished,
        verify_swap_in=loop.verify_swap_in,
        verify_end=loop.verify_end,
        running_at_end=loop.running_at_end,
        swapped_at_end=loop.swapped_at_end,
        unverified_requests=loop.unverified,
        corrupted=loop.corrupted,
    )


def _run(ctl: CacheController, config: DemoConfig, progress: bool, start: float) -> DemoResult:
    requests, sizing = _prepare(ctl, config)
    device_bytes, host_bytes = ctl.device_bytes, ctl.host_bytes
    _warm_up(ctl)
    loop = _Loop(ctl, config, requests)
    _serve(loop, config, sum(r.output_len for r in requests), progress)
    loop.finish()
    if config.corrupt_after_step is not None and not loop.corrupted:
        raise SelfTestOutOfRange(config.corrupt_after_step, loop.steps, loop.last_live_step)
    groups = _group_usage(ctl, loop)
    ctl.platform.synchronize()
    ctl.free()
    return DemoResult(
        model=config.model,
        device=str(ctl.device),
        seed=config.seed,
        requests_total=len(requests),
        requests_finished=sum(r.state == "finished" for r in requests),
        wall_seconds=time.perf_counter() - start,
        device_memory_budget=sizing.budget,
        device_cache_bytes=device_bytes,
        host_cache_bytes=host_bytes,
        device_share=float(sizing.share),
        longest_request=sizing.longest,
        groups=groups,
        **_loop_counts(loop),
    )


# ---------------------------------------------------------------------------------- summary


# ---------------------------------------------------------------------------------- command


Tier = Literal["device", "host", "redis", "mooncake"]


def _tier(args: argparse.Namespace) -> tuple[Tier, str | None]:
    """``--tier`` and the store address given for it, refused where they cannot apply (a
    usage error, never ignored), under the rules ``kvforge bench --tiers`` shares
    (:mod:`kvforge.cli.remotes`)."""
    tier = args.tier
    if tier != "device" and args.prefix_conversations == 0:
        raise UsageError(
            f"--tier {tier} applies to the prefix-reuse phase, which --prefix-conversations 0 skips"
        )
    given = {"redis": args.redis, "mooncake": args.mooncake_master}
    chosen = (tier,) if tier in REMOTE_TIERS else ()
    return tier, given_addresses(given, chosen, "--tier", tier).get(tier)


def cmd_demo(args: argparse.Namespace) -> int:
    """``kvforge demo``: the serving loop; exit 1 on a mismatch (the self-test's included)."""
    if args.list_models:
        return list_models(args)
    if args.json is not None:
        check_output_path(args.json, "--json")
    if not (args.model or args.config or args.backend):
        args.model = DEFAULT_MODEL
    tier, address = _tier(args)
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
        tier=tier,
        store_address=address,
    )
    progress = not args.no_progress and sys.stderr.isatty()
    try:
        result = run_demo(config, progress=progress, backends=backends)
    except SelfTestOutOfRange as exc:
        raise UsageError(exc.describe(f"--self-test-corrupt {exc.step}")) from None
    except StoreUnavailable as exc:  # a missing server or client, or one that does not answer
        raise UsageError(f"--tier {tier}: {exc}") from None
    if args.json is not None:
        write_text(args.json, result.model_dump_json(indent=2) + "\n")
    print_summary(result)
    return 0 if result.ok else 1
