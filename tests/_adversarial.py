"""The two processes of ``test_two_sides_adversarial.py``: a scheduler that drives a worker with
what an engine's transport, retries or a second scheduler could send (replayed plans,
reordered, skipped and repeated deltas, foreign plans, out-of-range and null block ids, copies
aimed at another request's blocks), and a worker that answers each value with ``ok`` or the
refusal's type and message. Modelled on ``_two_sides.py``; imports happen inside the
functions."""

from __future__ import annotations

from typing import Any

BLOCKS, ROWS, MAX_LEN, CHUNK = 40, 8, 512, 32


def build() -> dict:
    """gpt-oss shaped and small: a sliding-window group ``swa`` and a full group ``kv``."""
    from kvforge.attn_backends import GQABackend

    swa = GQABackend(2, 8, block_size=16, sliding_window=32)
    kv = GQABackend(2, 8, block_size=16)
    return {0: swa, 1: kv, 2: swa, 3: kv}


# ====================================================================== worker


def worker_main(conn: Any) -> None:
    import hashlib
    import traceback

    import numpy as np
    import torch

    from kvforge.core.layout import CacheLayout
    from kvforge.errors import WorkerRefusedError
    from kvforge.kinds import live_start
    from kvforge.verify import entry_bytes_for, read_entries, write_entries
    from kvforge.worker import CacheStorage

    layout = CacheLayout(build())
    storage = CacheStorage(layout, "cpu")

    def entries(row: int, num_tokens: int, seed: int):
        for e in layout.buffers:
            pos = np.arange(live_start(e.group, num_tokens), num_tokens, dtype=np.int64)
            slots = storage.slot_mapping(row, e.group.name, pos, e.role.compress_ratio)
            keep = slots >= 0
            want = entry_bytes_for(seed, e, torch.from_numpy(pos[keep]), e.role.entry_bytes)
            yield storage.kv_caches[e.index], e, torch.from_numpy(slots[keep]), want

    def digest() -> str:
        h = hashlib.sha256(str(storage.next_seq).encode())
        for g in layout.groups:
            h.update(storage.block_table(g.name).tobytes())
        for cache in storage.kv_caches:
            h.update(cache.view(torch.uint8).numpy().tobytes())
        for pool in storage.host.groups.values():
            h.update(pool.pages.numpy().tobytes())
        return h.hexdigest()

    handlers = {
        "create": lambda p: storage.create(*p),
        "init_host": storage.init_host,
        "apply": lambda p: storage.apply(p) and None,
        "deltas": storage.apply_deltas,
        "copies": storage.copy_blocks,
        "execute": lambda p: storage.execute(p).result,
        "digest": lambda p: digest(),
    }
    while True:
        op, payload = conn.recv()
        if op == "stop":
            conn.send(("ok", None))
            return
        try:
            if op == "write":
                reply: Any = 0
                for row, num_tokens, seed in payload:
                    for cache, e, slots, want in entries(row, num_tokens, seed):
                        write_entries(cache, e, slots, want)
                        reply += len(slots)
            elif op == "verify":
                reply = []
                for row, num_tokens, seed in payload:
                    total = bad = 0
                    for cache, e, slots, want in entries(row, num_tokens, seed):
                        total += len(slots)
                        bad += int((read_entries(cache, e, slots) != want).any(dim=1).sum())
                    reply.append((total, bad))
            else:
                reply = handlers[op](payload)
        except WorkerRefusedError as exc:
            conn.send(("refused", (type(exc).__name__, str(exc))))
            continue
        except Exception:
            conn.send(("error", traceback.format_exc()))
            continue
        conn.send(("ok", reply))


# ====================================================================== scheduler


def scheduler_main(conn: Any, out: Any) -> None:
    """Run the scenario; report its figures, or the error, on ``out`` (never hang the test)."""
    try:
        out.put(_scheduler(conn))
    except BaseException:
        import traceback

        out.put({"error": traceback.format_exc()})
    conn.send(("stop", None))


def _scheduler(conn: Any) -> dict:
    import dataclasses
    import sys

    import numpy as np

    from kvforge.core.layout import CacheLayout
    from kvforge.core.swap_receipt import plan_receipt
    from kvforge.core.values import BlockCopy, RequestMove, SwapPlan, SwapResult, TableDelta
    from kvforge.errors import SwapReceiptError
    from kvforge.scheduler import BlockManager

    def send(op: str, payload: Any = None) -> tuple[str, Any]:
        conn.send((op, payload))
        return conn.recv()

    def call(op: str, payload: Any = None) -> Any:
        status, reply = send(op, payload)
        assert status == "ok", f"{op}: {status} {reply}"
        return reply

    layout = CacheLayout(build())
    blocks = dict.fromkeys((g.name for g in layout.groups), BLOCKS)

    def manager() -> BlockManager:
        m = BlockManager(layout, blocks, ROWS, MAX_LEN)
        m.init_host(blocks)
        return m

    sched = manager()
    call("create", (blocks, ROWS, MAX_LEN))
    call("init_host", blocks)
    lengths: dict[str, int] = {}
    seeds = {"a": 11, "b": 12, "c": 13, "d": 14}

    def end(step: Any) -> None:
        if hasattr(sched, "end_step"):
            sched.end_step(step)

    def grow(ids: list[str], total: int) -> None:
        for rid in ids:
            lengths.setdefault(rid, 0)
        while any(lengths[r] < total for r in ids):
            todo = [r for r in ids if lengths[r] < total]
            counts = [min(CHUNK, total - lengths[r]) for r in todo]
            step = sched.schedule(todo, counts)
            assert not step.refused
            call("apply", step)
            end(step)
            for r, n in zip(todo, counts, strict=True):
                lengths[r] += n
        write(ids)

    def rows(ids: list[str]) -> list[tuple[int, int, int]]:
        return [(sched.row_of(r), lengths[r], seeds[r]) for r in ids]

    def write(ids: list[str]) -> None:
        call("write", rows(ids))

    def swap(plan: SwapPlan) -> SwapResult:
        call("deltas", sched.take_table_deltas())
        result = call("execute", plan)
        sched.complete_swap(result)
        call("deltas", sched.take_table_deltas())
        return result

    cases: list[dict[str, Any]] = []

    def attempt(name: str, op: str, payload: Any, expected: str) -> None:
        """Send a value the worker must refuse; record what it said and what changed."""
        before = call("digest")
        status, reply = send(op, payload)
        after = call("digest")
        resident = [r for r in lengths if r in sched.requests]
        checks = call("verify", rows(resident))
        cases.append(
            {
                "name": name,
                "expected": expected,
                "status": status,
                "error": reply[0] if status == "refused" else repr(reply)[:300],
                "message": reply[1] if status == "refused" else "",
                "unchanged": before == after,
                "entries": sum(total for total, _ in checks),
                "bad": sum(bad for _, bad in checks),
            }
        )

    def table(rid: str, group: str = "kv") -> tuple[np.ndarray, np.ndarray]:
        row = sched.table(group)[sched.row_of(rid)]
        cols = np.flatnonzero(row)
        return cols, row[cols].astype(np.int32)

    grow(["a", "b", "c"], 96)

    # --- deltas: skipped, reordered, repeated, another scheduler's, out of range
    s1 = sched.schedule(["a", "b"], [CHUNK, CHUNK])
    s2 = sched.schedule(["a", "b"], [CHUNK, CHUNK])
    assert len(s1.table_deltas) >= 2
    attempt("step 2 before step 1 (a skipped step)", "apply", s2, "DeltaOrderError")
    attempt("step 1's deltas reversed", "deltas", s1.table_deltas[::-1], "DeltaOrderError")
    attempt("step 1's deltas, first one skipped", "deltas", s1.table_deltas[1:], "DeltaOrderError")
    call("apply", s1)
    attempt("step 1 again (a repeat)", "apply", s1, "DeltaOrderError")
    attempt("step 1's deltas again", "deltas", s1.table_deltas, "DeltaOrderError")
    call("apply", s2)
    end(s1)
    end(s2)
    for r in ("a", "b"):
        lengths[r] += 2 * CHUNK
    write(["a", "b"])
    foreign = manager()
    foreign.schedule(["x"], [64])
    attempt(
        "deltas of another scheduler",
        "deltas",
        foreign.schedule(["x"], [16]).table_deltas,
        "DeltaOrderError",
    )
    assert not sched.take_table_deltas()  # nothing pending: forged deltas take the next seq
    seq = s2.table_deltas[-1].seq + 1
    a_row = sched.row_of("a")

    def forged_delta(**fields: Any) -> TableDelta:
        arrays = {k: np.array(v, dtype=np.int32) for k, v in fields.items() if k != "group"}
        return TableDelta(group=fields.get("group", "kv"), seq=seq, **arrays)

    attempt(
        "delta with block id 10000 (a 40-block pool)",
        "deltas",
        [forged_delta(rows=[a_row], cols=[0], block_ids=[10_000])],
        "BlockRangeError",
    )
    attempt(
        "delta with block id -1",
        "deltas",
        [forged_delta(rows=[a_row], cols=[0], block_ids=[-1])],
        "BlockRangeError",
    )
    attempt(
        "delta with row -1",
        "deltas",
        [forged_delta(rows=[-1], cols=[0], block_ids=[1])],
        "BlockRangeError",
    )
    attempt(
        "step with row -1",
        "apply",
        dataclasses.replace(s2, rows=np.full(len(s2.rows), -1, dtype=np.int32), table_deltas=()),
        "BlockRangeError",
    )

    # --- plans: replayed after completion
    p_out = sched.plan_swap_out(["c"])
    assert swap(p_out).ok
    p_in = sched.plan_swap_in(["c"])
    assert swap(p_in).ok
    c_blocks = set(table("c")[1].tolist())
    sched.finish(["c"])
    call("deltas", sched.take_table_deltas())
    del lengths["c"]
    grow(["d"], 96)
    reused = bool(c_blocks & set(table("d")[1].tolist()))
    attempt("swap in replayed after completion", "execute", p_in, "PlanReplayError")
    attempt("swap out replayed after completion", "execute", p_out, "PlanReplayError")

    # --- foreign plans: another scheduler's ids and blocks
    other = manager()
    other.end_step(other.schedule(["filler"], [200]))  # its blocks differ from this worker's
    other.end_step(other.schedule(["x"], [96]))
    plan = other.plan_swap_out(["x"])
    attempt("another scheduler's plan 1 (id reused)", "execute", plan, "PlanReplayError")
    while plan.plan_id <= p_in.plan_id:  # advance its ids past this worker's
        # never executed: the scheduler side takes a success only with the plan's receipt
        other.complete_swap(SwapResult(plan.plan_id, receipt=plan_receipt(plan)))
        other.take_table_deltas()
        plan = other.plan_swap_in(["x"]) if plan.direction == "out" else other.plan_swap_out(["x"])
    attempt(
        f"another scheduler's plan {plan.plan_id} (fresh id)",
        "execute",
        plan,
        "BlockOwnershipError",
    )

    # --- forged plans: null and out-of-range ids, another request's blocks
    cols, b_blocks = table("b")

    def forged_plan(direction: str, rid: str, c: Any, d: Any, pages: Any, pid: int) -> SwapPlan:
        move = RequestMove(
            request_id=rid,
            num_tokens=lengths.get(rid, 16),
            purpose=p_out.requests[0].purpose,
            block_indices={"kv": np.asarray(c, dtype=np.int64)},
            device_blocks={"kv": np.asarray(d, dtype=np.int32)},
            host_pages={"kv": np.asarray(pages, dtype=np.int32)},
        )
        return SwapPlan(pid, direction, (move,), ("kv",))  # type: ignore[arg-type]

    fresh = 1000
    attempt(
        "swap in to the null block",
        "execute",
        forged_plan("in", "z", [0], [0], [1], fresh),
        "BlockRangeError",
    )
    attempt(
        "swap in to block 10000",
        "execute",
        forged_plan("in", "z", [0], [10_000], [1], fresh + 1),
        "BlockRangeError",
    )
    attempt(
        "swap out to host page 10000",
        "execute",
        forged_plan("out", "b", cols, b_blocks, [10_000] * len(cols), fresh + 2),
        "BlockRangeError",
    )
    attempt(
        "swap in onto b's blocks",
        "execute",
        forged_plan("in", "z", cols, b_blocks, list(range(1, len(cols) + 1)), fresh + 3),
        "BlockOwnershipError",
    )

    # --- copies: null and out-of-range ids, another request's blocks
    _, a_blocks = table("a")
    attempt(
        "copy to block -1",
        "copies",
        [BlockCopy("kv", a_blocks[:1], np.array([-1], np.int32))],
        "BlockRangeError",
    )
    attempt(
        "copy to the null block",
        "copies",
        [BlockCopy("kv", a_blocks[:1], np.array([0], np.int32))],
        "BlockRangeError",
    )
    attempt(
        "copy from block 10000",
        "copies",
        [BlockCopy("kv", np.array([10_000], np.int32), b_blocks[:1])],
        "BlockRangeError",
    )
    attempt(
        "snapshot copy into b's block",
        "copies",
        [BlockCopy("kv", a_blocks[:1], b_blocks[-1:], -1)],
        "BlockOwnershipError",
    )
    attempt(
        "copy for a's row into b's block",
        "copies",
        [BlockCopy("kv", a_blocks[:1], b_blocks[:1], a_row)],
        "BlockOwnershipError",
    )
    _, b_swa = table("b", "swa")
    attempt(
        "copy into b's window block",
        "copies",
        [BlockCopy("swa", table("a", "swa")[1][:1], b_swa[-1:], a_row)],
        "BlockOwnershipError",
    )

    # --- swap messages against the worker's own swap ledger (issue 32, class 10): d's swap
    # in sent as a swap out would overwrite d's swapped pages; a success the worker never
    # reported is refused by the scheduler side
    assert swap(sched.plan_swap_out(["d"])).ok
    d_in = sched.plan_swap_in(["d"])
    call("deltas", sched.take_table_deltas())
    flipped = dataclasses.replace(d_in, direction="out")
    attempt("d's swap in with its direction flipped", "execute", flipped, "PageOwnershipError")
    result = call("execute", d_in)
    sched.complete_swap(result)
    call("deltas", sched.take_table_deltas())
    a_out = sched.plan_swap_out(["a"])
    try:
        sched.complete_swap(SwapResult(a_out.plan_id))  # never executed
        receipt_refused = False
    except SwapReceiptError:
        receipt_refused = True
    assert swap(a_out).ok and swap(sched.plan_swap_in(["a"])).ok

    # --- after all of it the protocol goes on: a swap round trip, every byte checked
    assert swap(sched.plan_swap_out(["b"])).ok
    assert swap(sched.plan_swap_in(["b"])).ok
    final = call("verify", rows(["a", "b", "d"]))
    sched.finish(["a", "b", "d"])
    call("deltas", sched.take_table_deltas())
    return {
        "cases": cases,
        "receipt_refused": receipt_refused,
        "reused": reused,
        "final": final,
        "pools_full": all(sched.num_used_blocks(g) == 0 for g in sched.groups),
        "forbidden": sorted(
            m for m in sys.modules if m.startswith(("kvforge.worker", "kvforge.ops"))
        ),
    }
