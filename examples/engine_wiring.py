"""How an engine runtime wires the controller in.

1. build the backends from a model config and the controller from them;
2. size the caches from a device memory budget for ``max_num_seqs`` x ``max_model_len``;
3. hand the ordered caches to the attention kernels, located with ``index_of``;
4. each step: grow block tables, compute slot mappings, write the new tokens' entries;
5. when the pools run dry: preempt a request to host memory, resume it later.

Run: ``python examples/engine_wiring.py [--model deepseek-v4-tiny]``
"""

from __future__ import annotations

import argparse

import torch

from kvforge import CacheController, OutOfBlocksError
from kvforge.core.layout import CacheBuffer
from kvforge.models import from_hf_config
from kvforge.verify import entry_bytes_for, verify_request, write_entries


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


def main(model: str = "deepseek-v4-tiny", steps: int = 80) -> dict[str, int]:
    backends = from_hf_config(model)
    ctl = CacheController(backends, device="cpu")
    # Small on purpose: 11 usable compressed blocks of 256 tokens cannot hold all four
    # requests (5 + 6 + 3 + 4 blocks), so decoding preempts. Prompts are prefilled in
    # 256-token chunks; a window group holds a chunk's blocks on top of its window until the
    # request's next step.
    plan = ctl.initialize_kv_cache(
        num_blocks={"swa": 24, "compressed": 12, "c4_state": 96, "c128_state": 78},
        max_num_seqs=4,
        max_model_len=2048,
    )
    ctl.initialize_host_cache(memory_budget=32 << 20)
    print(f"{model}: groups {ctl.groups}, blocks {plan.num_blocks}, max tokens {plan.max_tokens}")
    layers = [AttentionLayer(ctl, layer) for layer in ctl.layout.layers]

    def write(rid: str, positions: list[int]) -> None:
        for layer in layers:
            layer.write(ctl, rid, seed=ord(rid), positions=positions)

    waiting = {"a": 1200, "b": 1510, "c": 700, "d": 1000}  # request id -> prompt tokens
    outputs = {"a": 30, "b": 40, "c": 60, "d": 10}  # tokens to generate
    prompts = dict(waiting)
    running: list[str] = []  # admission order
    preempted: list[str] = []  # oldest first
    counters = {"preemptions": 0, "resumes": 0, "verified": 0, "mismatched": 0}
    for step in range(steps):
        if preempted:  # resume the oldest preempted request once it fits again
            try:
                ctl.swap_in(preempted[0]).wait()
                running.append(preempted.pop(0))
                counters["resumes"] += 1
            except OutOfBlocksError:
                pass
        for rid, prompt in list(waiting.items()):  # admit: prefill in chunks of 256 tokens
            try:
                for end in range(256, prompt + 256, 256):
                    ctl.allocate(rid, min(end, prompt))
            except OutOfBlocksError:
                if rid in ctl.requests:
                    ctl.free_request(rid)  # a chunk did not fit: try again next step
                break
            write(rid, list(range(prompt)))
            running.append(rid)
            del waiting[rid]
        for rid in list(running):  # decode one token each
            if rid not in running:
                continue  # preempted earlier in this step
            n = ctl.num_tokens(rid)
            while True:
                try:
                    ctl.allocate(rid, n + 1)
                    break
                except OutOfBlocksError:
                    victim = running[-1]  # preempt the newest request (possibly this one)
                    ctl.swap_out(victim).wait()
                    running.remove(victim)
                    preempted.append(victim)
                    counters["preemptions"] += 1
                    if victim == rid:
                        break
            if rid in running:
                write(rid, [n])
                if n + 1 == prompts[rid] + outputs[rid]:  # finished: check its bytes, free it
                    check = verify_request(ctl, rid, seed=ord(rid))
                    counters["verified"] += check.entries
                    counters["mismatched"] += check.mismatched
                    ctl.free_request(rid)
                    running.remove(rid)
                    print(f"step {step + 1}: {rid} finished")
        if step % 10 == 9:
            print(f"step {step + 1}: running {running}, preempted {preempted}")
        if not (waiting or running or preempted):
            break
    # bring everyone back to check their bytes: all in one call when they all fit (one data-path
    # call per group), else one by one, as many as fit
    try:
        ctl.swap_in_many(preempted)
        running += preempted
        preempted.clear()
    except OutOfBlocksError:
        for rid in list(preempted):
            try:
                ctl.swap_in(rid)
                preempted.remove(rid)
                running.append(rid)
            except OutOfBlocksError:
                pass
    for rid in running:
        check = verify_request(ctl, rid, seed=ord(rid))
        counters["verified"] += check.entries
        counters["mismatched"] += check.mismatched
    for rid in running + preempted:
        ctl.free_request(rid)
    ctl.free()
    print(
        f"preemptions {counters['preemptions']}, resumes {counters['resumes']}, verified "
        f"{counters['verified']} entries, {counters['mismatched']} mismatched"
    )
    return counters


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="deepseek-v4-tiny")
    parser.add_argument("--steps", type=int, default=80)
    args = parser.parse_args()
    main(args.model, args.steps)
