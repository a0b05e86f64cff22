"""Four threads share one controller with prefix caching: each schedules, ends steps, looks
up, swaps, truncates and frees its own requests, whose prompts share prefixes with the other
threads', and after every operation checks every byte of every request it owns. No call
order or thread timing may let one request read or overwrite another's KV.

Run at CI size here (3 seeds, 4 threads, 20,000 operations in all); ``KVFORGE_THREADS_OPS``
raises the operations per seed for a longer run (``docs/robustness.md``).
"""

from __future__ import annotations

import os
import random
import threading

import numpy as np
import pytest

from kvforge import CacheController, GQABackend, OutOfBlocksError, PrefixQuery
from kvforge.verify import token_seeds, verify_request, write_step

THREADS = 4
OPS_PER_SEED = int(os.environ.get("KVFORGE_THREADS_OPS", 20_000 // 3 + 1))
#: a few shared heads, so the threads' prompts hit each other's cached blocks
HEADS = [np.random.default_rng(h).integers(0, 5_000, 48).tolist() for h in range(4)]


class Worker:
    def __init__(self, ctl: CacheController, index: int, seed: int, ops: int) -> None:
        self.ctl, self.index, self.ops = ctl, index, ops
        self.rng = random.Random(seed * 100 + index)
        self.tokens: dict[str, list[int]] = {}  # resident requests -> tokens written
        self.swapped: dict[str, list[int]] = {}
        self.seeds: dict[str, object] = {}  # request -> token_seeds of its tokens
        self.next_id = 0
        self.done = 0
        self.hits = 0
        self.error: BaseException | None = None

    def new_id(self) -> str:
        self.next_id += 1
        return f"t{self.index}-{self.next_id}"

    def op_new(self) -> None:
        if len(self.tokens) >= 2:
            return
        head = self.rng.choice(HEADS)[: self.rng.choice([16, 32, 48])]
        prompt = head + [self.rng.randrange(5_000) for _ in range(self.rng.randint(1, 16))]
        [match] = self.ctl.lookup([PrefixQuery(prompt)])
        rid = self.new_id()
        hit = match.num_tokens
        self.hits += bool(hit)
        step = self.ctl.schedule(
            [rid], [len(prompt) - hit], new_token_ids=[prompt[hit:]], prefix_matches=[match]
        )
        if step.allocation.refused:
            self.ctl.end_step(step)
            return
        self.set_tokens(rid, prompt)
        write_step(self.ctl, step, {rid: self.seeds[rid]})
        self.ctl.end_step(step)

    def op_grow(self) -> None:
        if not self.tokens:
            return
        rid = self.rng.choice(sorted(self.tokens))
        if len(self.tokens[rid]) > 90:
            return
        new = [self.rng.randrange(5_000) for _ in range(self.rng.choice([1, 1, 4]))]
        step = self.ctl.schedule([rid], [len(new)], new_token_ids=[new])
        if step.allocation.refused:
            self.ctl.end_step(step)
            return
        self.set_tokens(rid, self.tokens[rid] + new)
        write_step(self.ctl, step, {rid: self.seeds[rid]})
        self.ctl.end_step(step)

    def op_swap(self) -> None:
        if self.swapped and self.rng.random() < 0.6:
            rid = self.rng.choice(sorted(self.swapped))
            try:
                self.ctl.swap_in(rid)
            except OutOfBlocksError:
                return
            self.tokens[rid] = self.swapped.pop(rid)
        elif self.tokens:
            rid = self.rng.choice(sorted(self.tokens))
            try:
                self.ctl.swap_out(rid)
            except OutOfBlocksError:
                return
            self.swapped[rid] = self.tokens.pop(rid)

    def op_truncate(self) -> None:
        if not self.tokens:
            return
        rid = self.rng.choice(sorted(self.tokens))
        n = len(self.tokens[rid])
        if n < 3:
            return
        keep = self.rng.randint(max(1, n - 3), n - 1)
        try:
            self.ctl.truncate(rid, keep)
        except (ValueError, OutOfBlocksError):
            return  # below a released window block, or no block for a copy on write
        self.set_tokens(rid, self.tokens[rid][:keep])

    def op_free(self) -> None:
        pool = sorted(self.tokens) + sorted(self.swapped)
        if not pool:
            return
        rid = self.rng.choice(pool)
        self.ctl.free_request(rid)
        self.tokens.pop(rid, None)
        self.swapped.pop(rid, None)

    def set_tokens(self, rid: str, tokens: list[int]) -> None:
        self.tokens[rid] = tokens
        self.seeds[rid] = token_seeds(tokens)

    def check(self) -> None:
        for rid in self.tokens:
            result = verify_request(self.ctl, rid, self.seeds[rid])
            assert result.mismatched == 0, (rid, result)

    def run(self) -> None:
        ops = (
            [self.op_new] * 3
            + [self.op_grow] * 6
            + [self.op_swap, self.op_truncate]
            + [self.op_free] * 2
        )
        try:
            for _ in range(self.ops):
                self.rng.choice(ops)()
                self.check()
                self.done += 1
        except BaseException as exc:  # reported by the main thread
            self.error = exc


@pytest.mark.soak
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_four_threads_never_touch_each_others_kv(seed: int) -> None:
    ctl = CacheController({0: GQABackend(1, 8, 4)}, enable_prefix_caching=True)
    ctl.initialize_kv_cache(num_blocks=160, max_num_seqs=12, max_model_len=128)
    ctl.initialize_host_cache(num_pages=120)
    workers = [Worker(ctl, i, seed, OPS_PER_SEED // THREADS) for i in range(THREADS)]
    threads = [threading.Thread(target=w.run) for w in workers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for w in workers:
        if w.error is not None:
            raise w.error
    assert sum(w.done for w in workers) == THREADS * (OPS_PER_SEED // THREADS)
    assert sum(w.hits for w in workers) > 0  # the threads did share prefixes
    for w in workers:
        w.check()
        for rid in [*w.tokens, *w.swapped]:
            ctl.free_request(rid)
    assert ctl.scheduler.open_steps == []
    ctl.scheduler.reset_prefix_cache()
    assert all(ctl.num_used_blocks(g) == 0 for g in ctl.groups)
