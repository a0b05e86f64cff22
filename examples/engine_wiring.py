"""How an engine runtime wires the controller in, for any bundled model.

1. build the backends from a model config and the controller from them;
2. size the caches from a device memory budget for ``max_num_seqs`` x ``max_model_len``
   (:func:`device_budget`: a deliberately small device, so that decoding must preempt);
3. hand the ordered caches to the attention kernels, located with ``index_of``;
4. each step: grow block tables, compute slot mappings, write the new tokens' entries;
5. when the pools run dry: preempt a request to host memory, resume it later;
6. at the end, check every cached byte of every request.

Nothing here names a group or a role: the groups come from the model's plan, so the same
loop serves a dense model, sliding windows, DeepSeek-V4's compressed and state groups, or
linear attention's per-request state.

Run: ``python examples/engine_wiring.py [--model deepseek-v4-tiny] [--max-model-len 1024]``
(any name ``kvforge.models.bundled_models()`` lists; ``tests/test_examples.py`` runs every
one of them at a small ``--max-model-len``).
"""

from __future__ import annotations

import argparse

import torch

from kvforge import CacheController, OutOfBlocksError, cache_bytes_per_sequence
from kvforge.core.layout import CacheBuffer
from kvforge.models import from_hf_config
from kvforge.verify import entry_bytes_for, verify_request, write_entries

MAX_NUM_SEQS = 4
#: The four requests' prompt and output lengths, as fractions of ``max_model_len``. The
#: device holds about one and a half sequences of ``max_model_len`` (:func:`device_budget`):
#: the first two prompts fit side by side (0.5 + 0.6), and their outputs then outgrow it
#: (0.9 + 0.95).
PROMPTS = {"a": 0.50, "b": 0.60, "c": 0.30, "d": 0.40}
OUTPUTS = {"a": 0.40, "b": 0.35, "c": 0.10, "d": 0.10}


class AttentionLayer:
    """Stands in for an attention kernel: it finds its caches by role, never by position."""

    def __init__(self, ctl: CacheController, layer: int) -> None:
        self.entries: list[CacheBuffer] = [e for e in ctl.layout.buffers if e.layer == layer]
        caches = ctl.kv_caches  # the ordered list an engine passes to its kernels
        self.caches = {e.role.name: caches[ctl.index_of(e.role.name, layer)] for e in self.entries}

    def write(self, ctl: CacheController, request_id: str, seed: int, positions: list[int]) -> None:
        """Store the new tokens' entries at their slots (what the kernel's cache write does)."""
        pos = torch.tensor(positions, dtype=torch.int64)
        for e in self.entries:
            slots = ctl.slot_mapping(request_id, e.group.name, pos, e.role.compress_ratio)
            keep = slots >= 0
            if keep.any():  # through the role's block layout (blocks may be padded)
                data = entry_bytes_for(seed, e, pos[keep], e.role.entry_bytes)
                write_entries(self.caches[e.role.name], e, slots[keep], data)


def device_budget(ctl: CacheController, max_model_len: int, chunk: int) -> int:
    """The cache budget of a small device: the least that plans two sequences of three
    quarters of ``max_model_len`` at once, and one of ``max_model_len`` (one and a half
    sequences of history, two windows and two requests' state), beside what the plan
    reserves whatever the length (window allowances for a step's chunk). A real engine
    passes the device memory left after its weights; this one is small on purpose, so that
    decoding preempts where history fills the device. A model whose budget is set by what
    the plan reserves per sequence (windows and compressor states for ``max_num_seqs``
    requests, as DeepSeek-V4-Flash at 1,024 tokens) keeps room to spare in its compressed
    history, and runs without preempting.

    Found by bisection over :meth:`CacheController.plan_memory`, which allocates nothing.
    """
    shorter = max_model_len * 3 // 4

    def plans(budget: int) -> bool:
        try:
            plan = ctl.plan_memory(budget, MAX_NUM_SEQS, shorter, max_num_batched_tokens=chunk)
            # and the engine's own plan at the full length must hold one sequence
            ctl.plan_memory(budget, MAX_NUM_SEQS, max_model_len, max_num_batched_tokens=chunk)
        except ValueError:
            return False  # too small for the reservations or for one sequence
        return (plan.max_concurrency or 0) >= 2

    one = 2 * cache_bytes_per_sequence(ctl.layout, shorter)
    low, high = one // 2, 2 * one
    while not plans(high):
        low, high = high, 2 * high
    while high - low > max(1, one // 256):
        middle = (low + high) // 2
        low, high = (low, middle) if plans(middle) else (middle, high)
    return high


class Engine:
    """The scheduling loop of a toy engine: admission with chunked prefill, one decode token
    per running request per step, preemption of the newest request when the pools run dry."""

    def __init__(self, ctl: CacheController, max_model_len: int, chunk: int) -> None:
        self.ctl, self.chunk = ctl, chunk
        self.layers = [AttentionLayer(ctl, layer) for layer in ctl.layout.layers]
        self.prompts = {rid: max(1, int(f * max_model_len)) for rid, f in PROMPTS.items()}
        self.lengths = {rid: self.prompts[rid] + max(1, int(OUTPUTS[rid] * max_model_len))
                        for rid in PROMPTS}  # fmt: skip
        self.waiting = dict(self.prompts)  # request id -> prompt tokens
        self.running: list[str] = []  # admission order
        self.preempted: list[str] = []  # oldest first
        self.finished = False  # a request finished since the last resume
        self.counters = {"preemptions": 0, "resumes": 0, "verified": 0, "mismatched": 0}

    def write(self, rid: str, positions: list[int]) -> None:
        for layer in self.layers:
            layer.write(self.ctl, rid, seed=ord(rid), positions=positions)

    def step(self) -> bool:
        """One engine iteration; False once every request finished."""
        # resume the oldest preempted request once a request finished (else it would be
        # preempted again at once) or nothing runs, and it fits
        if self.preempted and (self.finished or not self.running):
            try:
                self.ctl.swap_in(self.preempted[0]).wait()
                self.running.append(self.preempted.pop(0))
                self.counters["resumes"] += 1
                self.finished = False
            except OutOfBlocksError:
                pass
        self.admit()
        for rid in list(self.running):  # decode one token each
            if rid in self.running:  # (not preempted earlier in this step)
                self.decode(rid)
        return bool(self.waiting or self.running or self.preempted)

    def admit(self) -> None:
        """Prefill waiting requests in chunks while they fit; a request whose chunk does not
        fit gives back what it took and waits for the next step."""
        for rid, prompt in list(self.waiting.items()):
            try:
                for end in range(self.chunk, prompt + self.chunk, self.chunk):
                    self.ctl.allocate(rid, min(end, prompt))
            except OutOfBlocksError:
                if rid in self.ctl.requests:
                    self.ctl.free_request(rid)
                break
            self.write(rid, list(range(prompt)))
            self.running.append(rid)
            del self.waiting[rid]

    def decode(self, rid: str) -> None:
        n = self.ctl.num_tokens(rid)
        while True:
            try:
                self.ctl.allocate(rid, n + 1)
                break
            except OutOfBlocksError:
                victim = self.running[-1]  # preempt the newest request (possibly this one)
                self.ctl.swap_out(victim).wait()
                self.running.remove(victim)
                self.preempted.append(victim)
                self.counters["preemptions"] += 1
                if victim == rid:
                    return
        self.write(rid, [n])
        if n + 1 == self.lengths[rid]:  # finished: check its bytes, free it
            self.check(rid)
            self.ctl.free_request(rid)
            self.running.remove(rid)
            self.finished = True

    def check(self, rid: str) -> None:
        result = verify_request(self.ctl, rid, seed=ord(rid))
        self.counters["verified"] += result.entries
        self.counters["mismatched"] += result.mismatched

    def drain(self) -> None:
        """Bring everyone back to check their bytes (all in one call when they all fit: one
        data-path call per group; else one by one, as many as fit), then free them all."""
        try:
            self.ctl.swap_in_many(self.preempted)
            self.running += self.preempted
            self.preempted.clear()
        except OutOfBlocksError:
            for rid in list(self.preempted):
                try:
                    self.ctl.swap_in(rid)
                    self.preempted.remove(rid)
                    self.running.append(rid)
                except OutOfBlocksError:
                    pass
        for rid in self.running:
            self.check(rid)
        for rid in self.running + self.preempted:
            self.ctl.free_request(rid)


def main(
    model: str = "deepseek-v4-tiny", steps: int = 10_000, max_model_len: int = 1024
) -> dict[str, int]:
    backends = from_hf_config(model)
    ctl = CacheController(backends, device="cpu")
    chunk = max(1, max_model_len // 8)  # prompts are prefilled in chunks of this many tokens
    budget = device_budget(ctl, max_model_len, chunk)
    plan = ctl.initialize_kv_cache(
        memory_budget=budget,
        max_num_seqs=MAX_NUM_SEQS,
        max_model_len=max_model_len,
        max_num_batched_tokens=chunk,
    )
    ctl.initialize_host_cache(num_pages=plan.num_blocks)  # room for every preempted request
    print(f"{model}: {budget:,} bytes: groups {ctl.groups}, blocks {plan.num_blocks}")
    engine = Engine(ctl, max_model_len, chunk)
    for step in range(steps):
        if not engine.step():
            break
        if step % 10 == 9:
            print(f"step {step + 1}: running {engine.running}, preempted {engine.preempted}")
    engine.drain()
    ctl.free()
    counters = engine.counters
    print(
        f"preemptions {counters['preemptions']}, resumes {counters['resumes']}, verified "
        f"{counters['verified']} entries, {counters['mismatched']} mismatched"
    )
    return counters


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="deepseek-v4-tiny")
    parser.add_argument("--steps", type=int, default=10_000, help="stop after this many steps")
    parser.add_argument("--max-model-len", type=int, default=1024, help="tokens, at least 16")
    args = parser.parse_args()
    if args.max_model_len < 16:
        parser.error(f"--max-model-len must be at least 16, got {args.max_model_len}")
    main(args.model, args.steps, args.max_model_len)
