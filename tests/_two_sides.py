"""The two processes of ``test_two_sides.py``: a scheduler and a worker that share only plain
values over a pipe. Imports happen inside the functions, so a scheduler process loads only
what its own function imports."""

from __future__ import annotations

import sys
from typing import Any

MODELS = ("gqa", "dsa", "deepseek-v4-tiny-mtp", "deepseek-v4-tiny-arena")
SCHEDULER_FORBIDDEN = ("kvforge.worker", "kvforge.ops", "kvforge.worker")


def build(model: str) -> dict:
    from kvforge.attn_backends import DSABackend, GQABackend
    from kvforge.models import from_hf_config

    if model == "gqa":
        return {i: GQABackend(4, 32, 16) for i in range(3)}
    if model == "dsa":
        return {i: DSABackend(block_size=64) for i in range(2)}
    return dict(from_hf_config("deepseek-v4-tiny", num_speculative_tokens=1))


def plain(value: Any) -> bool:
    """True when ``value`` holds no torch tensor (checked without importing torch)."""
    if type(value).__module__.startswith("torch"):
        return False
    if isinstance(value, dict):
        return all(plain(k) and plain(v) for k, v in value.items())
    if isinstance(value, list | tuple):
        return all(plain(v) for v in value)
    slots = getattr(type(value), "__slots__", ())
    if hasattr(value, "__dataclass_fields__"):
        return all(plain(getattr(value, f)) for f in value.__dataclass_fields__)
    return all(plain(getattr(value, s)) for s in slots if hasattr(value, s))


# ====================================================================== worker


def worker_main(conn: Any, model: str) -> None:
    import numpy as np
    import torch

    from kvforge.core.layout import CacheLayout
    from kvforge.kinds import live_start
    from kvforge.verify import entry_bytes_for, read_entries, write_entries
    from kvforge.worker import CacheStorage
    from kvforge.worker import transfer as swap

    layout = CacheLayout(build(model))
    storage = CacheStorage(layout, "cpu")
    fail_next = [False]
    real_move = swap.move_pages

    def move_or_fail(*args: Any, **kwargs: Any) -> None:
        if fail_next[0]:
            fail_next[0] = False
            raise MemoryError("injected copy failure")
        real_move(*args, **kwargs)

    import kvforge.worker.swap_execution as swap_execution

    swap_execution.move_pages = move_or_fail  # type: ignore[assignment]

    def entries(row: int, num_tokens: int, seed: int, skip: tuple[str, ...]):
        for e in layout.buffers:
            if e.group.name in skip:
                continue
            pos = np.arange(live_start(e.group, num_tokens), num_tokens, dtype=np.int64)
            slots = storage.slot_mapping(row, e.group.name, pos, e.role.compress_ratio)
            keep = slots >= 0
            want = entry_bytes_for(seed, e, torch.from_numpy(pos[keep]), e.role.entry_bytes)
            yield storage.kv_caches[e.index], e, torch.from_numpy(slots[keep]), want

    while True:
        op, payload = conn.recv()
        if op == "stop":
            conn.send(("ok", None))
            return
        if op == "create":
            storage.create(*payload)
            reply: Any = None
        elif op == "init_host":
            storage.init_host(payload)
            reply = None
        elif op == "apply":
            inputs = storage.apply(payload)
            reply = {f"{g}/{r}": int((s >= 0).sum()) for (g, r), s in inputs.slot_mappings.items()}
        elif op == "deltas":
            storage.apply_deltas(payload)
            reply = None
        elif op == "write":
            reply = 0
            for row, num_tokens, seed in payload:
                for cache, e, slots, want in entries(row, num_tokens, seed, ()):
                    write_entries(cache, e, slots, want)
                    reply += len(slots)
        elif op == "verify":
            rows, skip = payload
            reply = []
            for row, num_tokens, seed in rows:
                total = bad = 0
                for cache, e, slots, want in entries(row, num_tokens, seed, skip):
                    total += len(slots)
                    bad += int((read_entries(cache, e, slots) != want).any(dim=1).sum())
                reply.append((total, bad))
        elif op == "scribble":
            for cache in storage.kv_caches:
                cache.view(torch.uint8).fill_(0xA5)
            reply = None
        elif op == "fail_next_copy":
            fail_next[0] = True
            reply = None
        elif op == "execute":
            reply = storage.execute(payload).result
        else:  # pragma: no cover - a test bug
            raise ValueError(op)
        conn.send(("ok", reply))


# ====================================================================== scheduler


def scheduler_main(conn: Any, model: str, out: Any) -> None:
    """Run the scenario; report its figures, or the error, on ``out`` (never hang the test)."""
    try:
        out.put(_scheduler(conn, model))
    except BaseException:
        import traceback

        out.put({"error": traceback.format_exc()})
        conn.send(("stop", None))


def _scheduler(conn: Any, model: str) -> dict:
    from kvforge.core.layout import CacheLayout
    from kvforge.scheduler import BlockManager

    def call(op: str, payload: Any = None) -> Any:
        assert plain(payload), f"{op} would send a tensor"
        conn.send((op, payload))
        status, reply = conn.recv()
        assert status == "ok" and plain(reply), f"{op} answered a tensor"
        return reply

    layout = CacheLayout(build(model))
    blocks = dict.fromkeys((g.name for g in layout.groups), 160)
    arena = None
    if model.endswith("-arena"):  # the groups' bytes flow through one slab arena
        from kvforge.core.arena import plan_arena

        arena = plan_arena(layout, 64 << 20)
        assert arena is not None
        blocks.update({g: arena.num_blocks(g) for g in arena.groups})
    manager = BlockManager(layout, blocks, max_num_seqs=8, max_model_len=4096, arena=arena)
    call("create", (blocks, 8, 4096, True, arena))
    pages = {g.name: 160 for g in layout.groups if layout.host_page_bytes(g.name)}
    manager.init_host(pages)
    call("init_host", pages)
    lengths = {"a": 700, "b": 300}
    seeds = {"a": 11, "b": 12}
    done = dict.fromkeys(lengths, 0)
    while any(done[r] < n for r, n in lengths.items()):  # chunked prefill, 128 tokens a step
        ids = [r for r in lengths if done[r] < lengths[r]]
        counts = [min(128, lengths[r] - done[r]) for r in ids]
        step = manager.schedule(ids, counts)
        assert not step.refused
        manager.end_step(step)
        call("apply", step)
        for r, c in zip(ids, counts, strict=True):
            done[r] += c
    written = call("write", [(manager.row_of(r), n, seeds[r]) for r, n in lengths.items()])

    def swap(plan: Any) -> Any:
        call("deltas", manager.take_table_deltas())  # the worker checks plans against its mirror
        result = call("execute", plan)
        manager.complete_swap(result)
        call("deltas", manager.take_table_deltas())
        return result

    used = {g: manager.num_used_blocks(g) for g in manager.groups}
    assert swap(manager.plan_swap_out(["a", "b"])).ok
    call("scribble")
    call("fail_next_copy")
    failed = swap(manager.plan_swap_in(["a", "b"]))
    rolled_back = (
        not failed.ok
        and failed.failure.stage == "copy"
        and manager.swapped_requests == ["a", "b"]
        and all(manager.num_used_blocks(g) == 0 for g in manager.groups)
    )
    assert swap(manager.plan_swap_in(["b", "a"])).ok
    after = {g: manager.num_used_blocks(g) for g in manager.groups}
    checks = call("verify", ([(manager.row_of(r), n, seeds[r]) for r, n in lengths.items()], ()))
    manager.finish(["a", "b"])
    call("deltas", manager.take_table_deltas())
    call("stop")
    return {
        "written": written,
        "checks": checks,
        "rolled_back": rolled_back,
        "used_before": used,
        "used_after": after,
        "pools_full": all(manager.num_used_blocks(g) == 0 for g in manager.groups),
        "forbidden": sorted(m for m in sys.modules if m.startswith(SCHEDULER_FORBIDDEN)),
        "failure": None if failed.failure is None else failed.failure.message,
    }
