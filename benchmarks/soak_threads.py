"""The soak's threaded mode (``python benchmarks/soak.py --threads N``): N threads on one
controller, each owning its own requests, none ever reading or overwriting another's KV.

The controller is the soak's hybrid one (:func:`soak_setup.make_controller`: DeepSeek-V4
layers of compress ratios 1, 4 and 128 and a GQA sliding-window layer, prefix caching on; with
``--share-pools`` a full GQA layer that shares the sliding-window layer's pool), with table
rows and blocks for N threads. Each thread runs random operations on requests whose ids
carry its index (``t1-7``):

- ``admit``: look up a prompt that starts with one of a few heads every thread's prompts
  share (so a thread hits blocks another thread wrote; the main thread caches each head's
  first 512 tokens before the threads start, so every run has hits), schedule its first
  chunk with the match and its token ids;
- ``step``: one batch of its resident requests, each a prefill chunk of its prompt (up to
  200 tokens) or a few decode tokens, with token ids;
- ``swap`` (out or in), ``truncate`` and ``free``;
- with a remote tier (``--remote``), ``reset``: forget the device's and the host tier's cached
  prefixes, so later admissions are served by the store (another thread's match made before
  it is refused as stale, which is tolerated).

With ``--model`` the controller is that bundled model at soak size (:mod:`soak_tiers`), and
with ``--host-tier`` / ``--remote`` the tiers are attached as in the single-thread soak; a
per-request state slot is written with the state after the request's newest token and a
restored snapshot is checked before the admitting step writes.

A step's tokens are written when it is scheduled (its kernels run), and the step ends either
at once or one step late (the thread's next step is scheduled first, an asynchronous engine's
order). A truncation or swap out of a request in the thread's step in flight is sometimes
tried first and must be refused with the scheduler's ``RequestStateError``; then the step
ends. Freeing such a request is an abort and is allowed. Refusals that other threads' use of
the pools explains are tolerated (a step's out-of-blocks or row refusals, a ``stale_prefix``
refusal of a match whose blocks another thread's step evicted between the lookup and the
step, ``OutOfBlocksError`` of a swap or of a truncation's copy on write, the truncation
``ValueError`` for a released window block).

After every operation the thread verifies every byte of every resident request it owns
(:func:`kvforge.verify.verify_request` with :func:`kvforge.verify.token_seeds` of its
tokens: a block reused from another thread must hold what this thread's own prefix writes).
At the end every request is verified and freed, no step is open, and after
``reset_prefix_cache()`` no device block and no host page is in use.

At most ``MAX_OPEN_STEPS // 2`` threads: each keeps up to two steps open at once, and one more
would let the scheduler drop the oldest step unended.
"""

from __future__ import annotations

import argparse
import math
import random
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import soak_setup
import soak_tiers
import torch

from kvforge import CacheController, OutOfBlocksError, PrefixQuery
from kvforge.controller import ScheduledStep
from kvforge.errors import RequestStateError
from kvforge.scheduler.block_manager import MAX_OPEN_STEPS
from kvforge.verify import token_seeds, verify_request, write_step

__all__ = [
    "HEADS",
    "MAX_THREADS",
    "OPERATIONS",
    "ThreadReport",
    "ThreadsReport",
    "Worker",
    "main_threads",
    "make_threads_controller",
    "prime_heads",
    "run_threads",
    "threads_arg",
]

#: each thread keeps at most two steps open (its step in flight and the one it just scheduled)
MAX_THREADS = MAX_OPEN_STEPS // 2
#: resident requests a thread keeps at most (and as many swapped ones)
PER_THREAD = 2
#: a few long heads every thread's prompts start with (cut near multiples of the soak
#: controller's 256-token match boundary), so threads hit blocks other threads completed
HEADS = [
    np.random.default_rng(1000 + h).integers(0, soak_setup.VOCAB, 560).tolist() for h in range(3)
]
#: tokens of each head cached before the threads start (:func:`prime_heads`)
PRIMED_TOKENS = 512
#: requests stop decoding here (max_model_len is 768)
MAX_TOKENS = soak_setup.MAX_MODEL_LEN - 8
#: each thread's operations (``Worker.op_<name>``) and their weights
OPERATIONS = {"admit": 3, "step": 8, "swap": 2, "truncate": 2, "free": 2}
#: with a remote tier, one more: ``reset`` forgets the device's and the host tier's cached
#: prefixes (``reset_prefix_cache``), so later admissions find them in the store only
REMOTE_OPERATIONS = {**OPERATIONS, "reset": 1}


def threads_arg(text: str) -> int:
    """``--threads``: an int from 2 to :data:`MAX_THREADS` (argparse names the flag)."""
    try:
        n = int(text)
    except ValueError:
        n = None
    if n is None or not 2 <= n <= MAX_THREADS:
        raise argparse.ArgumentTypeError(
            f"must be an int from 2 to {MAX_THREADS}, got {text!r} (each thread keeps up to "
            f"two steps open, and at most {MAX_OPEN_STEPS} stay open)"
        )
    return n


def make_threads_controller(
    threads: int,
    share_pools: bool = False,
    arena: bool = False,
    model: str | None = None,
    host_tier: str | None = None,
) -> CacheController:
    """The soak's hybrid controller with prefix caching, rows and blocks for ``threads``
    (``arena``: the same bytes as one slab arena; ``model``: a bundled model at soak size,
    :data:`soak_tiers.MODELS`; ``host_tier``: a host tier of that policy)."""
    return soak_setup.make_controller(
        prefix=True,
        share_pools=share_pools,
        max_num_seqs=PER_THREAD * threads,
        scale=math.ceil(threads / 2),
        arena=arena,
        model=model,
        host_tier=host_tier,
    )


@dataclass
class ThreadReport:
    """What one thread did."""

    ops: Counter = field(default_factory=Counter)
    entries_verified: int = 0
    bytes_verified: int = 0
    mismatches: int = 0  # entries that read back wrong: must stay 0
    prefix_hits: int = 0  # admitted requests that started on a cached prefix
    reused_tokens: int = 0
    steps: int = 0
    steps_ended_late: int = 0  # ended after the thread's next step was scheduled
    in_flight_refused: int = 0  # truncations and swap outs refused while the step was open
    freed_in_flight: int = 0
    tolerated: Counter = field(default_factory=Counter)  # refusals other threads explain
    snapshots_verified: int = 0  # state entries compared right after a hit was adopted


@dataclass
class ThreadsReport:
    threads: list[ThreadReport]
    seconds: float = 0.0
    # the end state, after every request was freed and the prefix cache reset: open steps,
    # and per group the device blocks and host pages in use (all empty or 0)
    final_open_steps: list[int] = field(default_factory=list)
    final_used_blocks: dict[str, int] = field(default_factory=dict)
    final_host_pages: dict[str, int] = field(default_factory=dict)
    # --host-tier / --remote: the tiers' counters at the end (hit tokens past the device by
    # the host tier, remote fetches included; by the remote tier), the faults injected
    host_tier: dict[str, object] = field(default_factory=dict)
    remote: dict[str, object] = field(default_factory=dict)
    faults: Counter = field(default_factory=Counter)
    restarts: int = 0

    @property
    def ops(self) -> int:
        return sum(t.ops.total() for t in self.threads)

    def total(self, name: str) -> int:
        return sum(getattr(t, name) for t in self.threads)


class Worker:
    """One thread's requests and operations on the shared controller."""

    def __init__(self, ctl: CacheController, index: int, seed: int, ops: int) -> None:
        self.ctl, self.index, self.ops = ctl, index, ops
        self.rng = random.Random(seed * 1_000 + index)
        self.tokens: dict[str, list[int]] = {}  # resident request -> tokens written
        self.swapped: dict[str, list[int]] = {}
        self.prompts: dict[str, list[int]] = {}  # request -> the prompt it prefills
        self.seeds: dict[str, torch.Tensor] = {}  # request -> token_seeds of its tokens
        self.live: dict[str, int] = {}  # request -> its live bytes, until it changes
        self.open: ScheduledStep | None = None  # this thread's step in flight
        self.next_id = 0
        self.report = ThreadReport()
        self.error: BaseException | None = None
        #: per-request (linear-attention state) groups: their slot holds the state after the
        #: newest token (:func:`soak_tiers.write_state`)
        self.per_request = frozenset(soak_tiers.per_request_groups(ctl))

    # ------------------------------------------------------------------ helpers

    def new_id(self) -> str:
        self.next_id += 1
        return f"t{self.index}-{self.next_id}"

    def set_tokens(self, rid: str, tokens: list[int]) -> None:
        self.tokens[rid] = tokens
        self.seeds[rid] = token_seeds(tokens)
        self.live.pop(rid, None)

    def advance(self, step: ScheduledStep) -> None:
        """The step's tokens are written: end it now, or keep it in flight and end the step
        before it (one step late)."""
        self.report.steps += 1
        if self.rng.random() < 0.5:
            self.ctl.end_step(step)
            return
        if self.open is not None:
            self.ctl.end_step(self.open)
            self.report.steps_ended_late += 1
        self.open = step

    def end_open_step(self) -> None:
        if self.open is not None:
            self.ctl.end_step(self.open)
            self.open = None

    def wait_for_open_step(self, rid: str, verb: str, call: Callable[[], object]) -> None:
        """Before truncating or swapping out ``rid``: if it is in the step in flight,
        sometimes try first (refused, and the request unchanged), then end the step."""
        if self.open is None or rid not in self.open.allocation.request_ids:
            return
        if self.rng.random() < 0.5:
            n = self.open.allocation.step_id
            message = (
                f"request {rid!r} is in step {n}, which has not ended; end_step({n}) before "
                f"it is {verb}"
            )
            try:
                call()
            except RequestStateError as err:
                assert str(err) == message, (str(err), message)
            else:
                raise AssertionError(f"{verb} of {rid!r} in open step {n} was not refused")
            assert self.ctl.num_tokens(rid) == len(self.tokens[rid]), rid
            assert rid in self.ctl.requests, rid
            self.report.in_flight_refused += 1
        self.end_open_step()

    def tolerate(self, refused: tuple, matched: bool = False) -> None:
        """Step refusals other threads explain: no blocks or rows left, or (``matched``: a
        new request scheduled with a lookup's match) a match gone stale because another
        thread's step evicted or rewrote a matched block between the lookup and the step."""
        reasons = ("out_of_blocks", "max_num_seqs", "stale_prefix")[: 3 if matched else 2]
        for r in refused:
            assert r.reason in reasons, r
            if r.reason == "out_of_blocks":
                assert r.needed > r.available, r
            self.report.tolerated[f"step {r.reason}"] += 1

    # ------------------------------------------------------------------ operations

    def new_prompt(self) -> list[int]:
        rng = self.rng
        head = rng.choice(HEADS)
        cut = rng.choice([256, 256, 512, 512, rng.randint(1, len(head))]) + rng.choice([-1, 0, 1])
        suffix = [rng.randrange(soak_setup.VOCAB) for _ in range(rng.randint(1, 120))]
        return head[: max(1, cut)] + suffix

    def op_admit(self) -> None:
        if len(self.tokens) >= PER_THREAD:
            return
        prompt = self.new_prompt()
        [match] = self.ctl.lookup([PrefixQuery(prompt)])
        hit = match.num_tokens
        rid = self.new_id()
        n = min(self.rng.randint(1, 200), len(prompt) - hit)
        step = self.ctl.schedule(
            [rid], [n], new_token_ids=[prompt[hit : hit + n]], prefix_matches=[match]
        )
        if step.allocation.refused:
            self.tolerate(step.allocation.refused, matched=True)
            self.advance(step)
            return
        n = int(step.allocation.num_new[0])  # (cut on a snapshot boundary)
        self.prompts[rid] = prompt
        self.set_tokens(rid, prompt[: hit + n])
        if self.per_request and hit:  # the snapshot at ``hit``, before the step writes
            self.report.snapshots_verified += soak_tiers.check_snapshots(
                self.ctl, rid, hit, self.seeds[rid]
            )
        self.write(step)
        self.advance(step)
        if hit:
            self.report.prefix_hits += 1
            self.report.reused_tokens += hit

    def op_step(self) -> None:
        if not self.tokens:
            return
        names = sorted(self.tokens)
        ids = self.rng.sample(names, self.rng.randint(1, len(names)))
        new: dict[str, list[int]] = {}
        for rid in ids:
            done, prompt = len(self.tokens[rid]), self.prompts[rid]
            if done < len(prompt):  # a prefill chunk
                new[rid] = prompt[done : done + self.rng.randint(1, 200)]
            elif done < MAX_TOKENS:  # a few decode tokens (or none)
                k = min(self.rng.choice([0, 1, 1, 2, 4]), MAX_TOKENS - done)
                new[rid] = [self.rng.randrange(soak_setup.VOCAB) for _ in range(k)]
            else:
                new[rid] = []
        step = self.ctl.schedule(
            ids, [len(new[r]) for r in ids], new_token_ids=[new[r] for r in ids]
        )
        self.tolerate(step.allocation.refused)
        got = step.allocation.num_new.tolist()  # (cut on a snapshot boundary)
        for rid, n in zip(step.allocation.request_ids, got, strict=True):
            self.set_tokens(rid, self.tokens[rid] + new[rid][:n])
        self.write(step)
        self.advance(step)

    def write(self, step: ScheduledStep) -> None:
        """Write the step's tokens (its kernels), and each request's state after its newest
        token into its per-request slots."""
        ids = step.allocation.request_ids
        write_step(self.ctl, step, {r: self.seeds[r] for r in ids})
        if self.per_request:
            for rid in ids:
                if self.tokens[rid]:
                    n = len(self.tokens[rid])
                    soak_tiers.write_state(self.ctl, rid, self.seeds[rid], n - 1)

    def op_swap(self) -> None:
        if self.swapped and (not self.tokens or self.rng.random() < 0.6):
            rid = self.rng.choice(sorted(self.swapped))
            if len(self.tokens) >= PER_THREAD:
                return
            try:
                self.ctl.swap_in(rid)
            except OutOfBlocksError:
                self.report.tolerated["swap_in OutOfBlocksError"] += 1
                return
            self.tokens[rid] = self.swapped.pop(rid)
            self.live.pop(rid, None)  # it holds its resting window now
        elif self.tokens and len(self.swapped) < PER_THREAD:
            rid = self.rng.choice(sorted(self.tokens))
            self.wait_for_open_step(rid, "swapped out", lambda: self.ctl.swap_out(rid))
            try:
                self.ctl.swap_out(rid)
            except OutOfBlocksError:
                self.report.tolerated["swap_out OutOfBlocksError"] += 1
                return
            self.swapped[rid] = self.tokens.pop(rid)

    def op_truncate(self) -> None:
        if not self.tokens:
            return
        rid = self.rng.choice(sorted(self.tokens))
        n = len(self.tokens[rid])
        if n < 3:
            return
        keep = self.rng.randint(max(1, n - 40), n - 1)
        self.wait_for_open_step(rid, "truncated", lambda: self.ctl.truncate(rid, keep))
        try:
            self.ctl.truncate(rid, keep)
        except ValueError as err:
            assert "cannot truncate" in str(err), err  # below a released window block
            self.report.tolerated["truncate ValueError"] += 1
            return
        except OutOfBlocksError:  # no block for a copy on write
            self.report.tolerated["truncate OutOfBlocksError"] += 1
            return
        self.set_tokens(rid, self.tokens[rid][:keep])
        if self.per_request:  # a state cannot be cut back: the engine recomputes it
            soak_tiers.write_state(self.ctl, rid, self.seeds[rid], keep - 1)

    def op_reset(self) -> None:
        """Forget every cached prefix of the device and the host tier (the store keeps its
        values): another thread's match made before it is refused as stale, tolerated."""
        self.ctl.scheduler.reset_prefix_cache()

    def op_free(self) -> None:
        pool = sorted(self.tokens) + sorted(self.swapped)
        if not pool:
            return
        rid = self.rng.choice(pool)
        if self.open is not None and rid in self.open.allocation.request_ids:
            self.report.freed_in_flight += 1  # an abort: allowed while its step is open
        self.ctl.free_request(rid)
        self.tokens.pop(rid, None)
        self.swapped.pop(rid, None)
        self.prompts.pop(rid, None)
        self.seeds.pop(rid, None)
        self.live.pop(rid, None)

    # ------------------------------------------------------------------ checks, the run

    def check(self) -> None:
        """Every byte of every resident request this thread owns reads back as written."""
        for rid in self.tokens:
            got = verify_request(self.ctl, rid, self.seeds[rid], skip_groups=self.per_request)
            if self.per_request and self.tokens[rid]:
                got += soak_tiers.verify_state(
                    self.ctl, rid, self.seeds[rid], len(self.tokens[rid]) - 1
                )
            self.report.entries_verified += got.entries
            if got.mismatched:
                self.report.mismatches += got.mismatched
                raise AssertionError(
                    f"thread {self.index}: request {rid!r}: {got.mismatched} of {got.entries} "
                    "entries differ"
                )
            if rid not in self.live:
                self.live[rid] = self.live_bytes(rid)
            self.report.bytes_verified += self.live[rid]

    def live_bytes(self, rid: str) -> int:
        """The bytes of ``rid``'s live entries (what a verify of it compares)."""
        total = 0
        n = len(self.tokens[rid])
        for e in self.ctl.layout.buffers:
            slots = self.ctl.slot_mapping(rid, e.group.name, range(n), e.role.compress_ratio)
            total += int((slots >= 0).sum()) * e.role.entry_bytes
        return total

    def run(
        self, tick: Callable[[], None] | None = None, stop: threading.Event | None = None
    ) -> None:
        """Run the thread's operations, checking after each; an error is kept for the main
        thread and sets ``stop``, which ends the other threads' runs early."""
        table = REMOTE_OPERATIONS if self.ctl.remote_tier is not None else OPERATIONS
        names = list(table)
        weights = list(table.values())
        try:
            for i in range(self.ops):
                if stop is not None and stop.is_set():
                    return
                name = self.rng.choices(names, weights)[0]
                try:
                    getattr(self, f"op_{name}")()
                    self.check()
                except AssertionError as err:
                    message = f"thread {self.index}, operation {i} ({name}): {err}"
                    raise AssertionError(message) from err
                except Exception as err:  # nothing a thread calls may raise unexpectedly
                    message = (
                        f"thread {self.index}, operation {i} ({name}): unexpected "
                        f"{type(err).__name__}: {err}"
                    )
                    raise AssertionError(message) from err
                self.report.ops[name] += 1
                if tick is not None:
                    tick()
            self.end_open_step()
        except BaseException as exc:  # reported by the main thread
            self.error = exc
            if stop is not None:
                stop.set()


def prime_heads(ctl: CacheController, chunk: int = 256) -> None:
    """Before the threads start, write each head's first :data:`PRIMED_TOKENS` tokens in one
    request, end its steps and free it: the heads are cached when the threads' first
    admissions look them up, so every run has prefix hits however its threads interleave."""
    state = frozenset(soak_tiers.per_request_groups(ctl))
    for h, head in enumerate(HEADS):
        rid, tokens = f"prime-{h}", head[:PRIMED_TOKENS]
        seeds = token_seeds(tokens)
        for start in range(0, len(tokens), chunk):
            piece = tokens[start : start + chunk]
            step = ctl.schedule([rid], [len(piece)], new_token_ids=[piece])
            assert not step.allocation.refused, step.allocation.refused
            assert int(step.allocation.num_new[0]) == len(piece)  # (512 is a snapshot boundary)
            write_step(ctl, step, {rid: seeds})
            if state:
                soak_tiers.write_state(ctl, rid, seeds, start + len(piece) - 1)
            ctl.end_step(step)
        got = verify_request(ctl, rid, seeds, skip_groups=state)
        if state:
            got += soak_tiers.verify_state(ctl, rid, seeds, len(tokens) - 1)
        assert got.mismatched == 0, got
        ctl.free_request(rid)


def run_threads(
    num_ops: int,
    seed: int,
    threads: int = 2,
    progress: Callable[[int], None] | None = None,
    share_pools: bool = False,
    arena: bool = False,
    model: str | None = None,
    host_tier: str | None = None,
    remote: str | None = None,
    fault_rate: float = 0.05,
    restart_every: int = 0,
) -> ThreadsReport:
    """``num_ops`` operations split over ``threads`` threads on one controller; raise the
    first thread's AssertionError (or any error) after all joined, and check the end state.
    ``model``, ``host_tier``, ``remote``, ``fault_rate``, ``restart_every``: as for
    :func:`soak.run_soak` (the server is started in this thread's private network
    namespace, which the threads inherit)."""
    if not 2 <= threads <= MAX_THREADS:
        raise ValueError(f"threads must be from 2 to {MAX_THREADS}, got {threads}")
    if remote is not None and host_tier is None:
        raise ValueError("a remote tier sits behind a host tier: give host_tier")
    with soak_tiers.remote_run(remote, fault_rate, seed, restart_every) as run:
        return _run_threads(
            num_ops, seed, threads, progress, share_pools, arena, model, host_tier, run
        )


def _run_threads(
    num_ops: int,
    seed: int,
    threads: int,
    progress: Callable[[int], None] | None,
    share_pools: bool,
    arena: bool,
    model: str | None,
    host_tier: str | None,
    remote: soak_tiers.RemoteRun | None,
) -> ThreadsReport:
    ctl = make_threads_controller(threads, share_pools, arena, model, host_tier)
    if remote is not None:
        remote.attach(ctl, model)
    prime_heads(ctl)
    shares = [num_ops // threads + (i < num_ops % threads) for i in range(threads)]
    workers = [Worker(ctl, i, seed, shares[i]) for i in range(threads)]
    lock = threading.Lock()
    stop = threading.Event()
    done = [0]

    def tick() -> None:
        with lock:
            done[0] += 1
        if remote is not None:
            remote.tick()  # (a Redis restart now and then, under the other threads' calls)

    start = time.perf_counter()
    pool = [
        threading.Thread(target=w.run, args=(tick, stop), name=f"soak-{w.index}") for w in workers
    ]
    for t in pool:
        t.start()
    while any(t.is_alive() for t in pool):
        for t in pool:
            t.join(timeout=0.2)
            if progress is not None:
                progress(done[0])
    if progress is not None:
        progress(done[0])
    for w in workers:
        if w.error is not None:
            raise w.error
    # the end: every request verified once more and freed, nothing open, held or cached
    for w in workers:
        w.check()
        for rid in [*w.tokens, *w.swapped]:
            ctl.free_request(rid)
    manager = ctl.scheduler
    report = ThreadsReport([w.report for w in workers], final_open_steps=manager.open_steps)
    assert report.final_open_steps == [], report.final_open_steps
    assert manager.requests == [] and manager.swapped_requests == []
    manager.reset_prefix_cache()
    report.final_used_blocks = {g: ctl.num_used_blocks(g) for g in ctl.groups}
    report.final_host_pages = {g: used for g, (used, _) in ctl.host_pool_usage().items()}
    assert not any(report.final_used_blocks.values()), report.final_used_blocks
    assert not any(report.final_host_pages.values()), report.final_host_pages
    if ctl.host_tier is not None:
        stats = ctl.host_tier.stats
        report.host_tier = {
            k: getattr(stats, k)
            for k in ("demotions", "evictions", "hits", "hit_tokens", "dropped", "skipped")
        }
        assert len(ctl.host_tier) == 0, len(ctl.host_tier)  # the reset forgot it too
    if remote is not None:
        report.remote = remote.finish()
        report.faults = Counter(remote.faults.injected)
        report.restarts = remote.restarts
    ctl.free()
    report.seconds = time.perf_counter() - start
    return report


def main_threads(args: argparse.Namespace) -> int:
    """``soak.py --threads N``: run with a progress bar and print a table per thread."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeRemainingColumn
    from rich.table import Table

    console = Console()
    with Progress(
        "[progress.description]{task.description}",
        BarColumn(),
        MofNCompleteColumn(),
        TimeRemainingColumn(),
        console=console,
    ) as bar:
        task = bar.add_task(f"soak {args.threads} threads, seed {args.seed}", total=args.ops)
        report = run_threads(
            args.ops,
            args.seed,
            args.threads,
            lambda n: bar.update(task, completed=n),
            share_pools=args.share_pools,
            arena=getattr(args, "arena", False),
            model=getattr(args, "model", None),
            host_tier=getattr(args, "host_tier", None),
            remote=getattr(args, "remote", None),
            fault_rate=getattr(args, "fault_rate", 0.05),
            restart_every=getattr(args, "restart_every", 0),
        )
    title = f"soak: {args.threads} threads on one controller, {args.ops} operations"
    table = Table(title=f"{title}, seed {args.seed}")
    rows: list[tuple[str, Callable[[ThreadReport], object]]] = [
        ("operations", lambda t: t.ops.total()),
        *((f"  {name}", lambda t, n=name: t.ops[n]) for name in REMOTE_OPERATIONS),
        ("steps", lambda t: t.steps),
        ("  ended one step late", lambda t: t.steps_ended_late),
        ("refused in flight", lambda t: t.in_flight_refused),
        ("freed in flight", lambda t: t.freed_in_flight),
        ("prefix hits", lambda t: t.prefix_hits),
        ("  reused tokens", lambda t: t.reused_tokens),
        ("refusals tolerated", lambda t: t.tolerated.total()),
        ("entries verified", lambda t: t.entries_verified),
        ("  state snapshots on adoption", lambda t: t.snapshots_verified),
        ("bytes verified", lambda t: t.bytes_verified),
        ("mismatches", lambda t: t.mismatches),
    ]
    table.add_column("")
    for i in range(args.threads):
        table.add_column(f"thread {i}", justify="right")
    table.add_column("all", justify="right")
    for label, get in rows:
        values = [get(t) for t in report.threads]
        table.add_row(label, *map(str, values), str(sum(values)))  # type: ignore[arg-type]
    console.print(table)
    tolerated = sum((t.tolerated for t in report.threads), start=Counter())
    kinds = ", ".join(f"{k} {n}" for k, n in sorted(tolerated.items()))
    console.print(f"refusals tolerated: {kinds or 'none'}")
    if report.host_tier:
        for name, value in report.host_tier.items():
            shown = soak_tiers.counts(value) if isinstance(value, dict) else value
            console.print(f"host tier {name}: {shown}")
    if report.remote:
        console.print(soak_tiers.remote_line(report.remote))
        console.print(
            f"store faults injected: {soak_tiers.counts(report.faults)}; server restarts: "
            f"{report.restarts}"
        )
    console.print(
        f"mismatches: {report.total('mismatches')}; time: {report.seconds:.1f} s; end state: "
        "every request freed, no step open, no block or host page in use"
    )
    return 0
