"""Swap messages checked against what each side holds itself (issue 32, class 10, swap half).

The worker keeps its own swap ledger (:mod:`kvforge.worker.swap_ledger`): which host pages
hold which swapped request's data, from the swap outs it executed, released only when the
scheduler side says so. The scheduler side takes a successful ``SwapResult`` only with the
worker's receipt of the very plan it issued (:mod:`kvforge.core.swap_receipt`).

Each row of ``ATTACKS`` is a call sequence an engine's transport, a retry or a forger could
produce, the typed error it must raise, and a fragment of its message. After each refusal:
not a byte of a device cache, host page or mirrored table moved, the worker's ledger, the
scheduler side's books (running, swapped, plans in flight, host pages held) and its swap
stats are as before, and every request's bytes (``kvforge.verify``) are intact once the
legitimate protocol goes on.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from _helpers import grow

from kvforge import CacheController, GQABackend
from kvforge.core.swap_receipt import plan_receipt
from kvforge.core.values import PageRelease, RequestMove, SwapFailure, SwapPlan, SwapResult
from kvforge.errors import (
    BlockOwnershipError,
    PageOwnershipError,
    SwapReceiptError,
    WorkerRefusedError,
)
from kvforge.verify import verify_request, write_request

BLOCKS = 48
FAILED = SwapFailure("copy", "", "RuntimeError", "the engine gave up on the plan")
LENGTHS = {"a": 64, "b": 80, "c": 48}  # a: 4 kv pages, 2 window pages


def backends() -> dict[int, GQABackend]:
    """gpt-oss shaped and small: a sliding-window group and a full group."""
    swa = GQABackend(2, 8, block_size=16, sliding_window=32)
    kv = GQABackend(2, 8, block_size=16)
    return {0: swa, 1: kv, 2: swa, 3: kv}


class Env:
    """A controller with a, b, c written; a swapped out."""

    def __init__(self) -> None:
        ctl = CacheController(backends())
        ctl.initialize_kv_cache(num_blocks=BLOCKS, max_num_seqs=8, max_model_len=512)
        ctl.initialize_host_cache(num_pages=BLOCKS)
        self.ctl, self.m, self.storage = ctl, ctl.scheduler, ctl.storage
        for i, (r, n) in enumerate(LENGTHS.items()):
            grow(ctl, r, n)
            assert write_request(ctl, r, seed=i, positions=range(n)) > 0
        ctl.swap_out("a")
        self.fresh = 10_000  # plan ids never issued
        self.lengths = dict(LENGTHS)  # the requests whose bytes are checked at the end

    def sync(self) -> None:
        self.ctl._sync_tables()  # mirror the scheduler side's changes, as the facade does

    def execute(self, plan: SwapPlan) -> SwapResult:
        return self.storage.execute(plan).result

    def swap(self, plan: SwapPlan) -> SwapResult:
        self.sync()
        result = self.execute(plan)
        self.m.complete_swap(result)
        self.sync()
        return result

    def forged_id(self) -> int:
        self.fresh += 1
        return self.fresh

    # ------------------------------------------------------------------ state

    def worker_digest(self) -> str:
        h = hashlib.sha256(str(self.storage.next_seq).encode())
        for g in self.ctl.groups:
            h.update(self.storage.block_table(g).tobytes())
        for cache in self.storage.kv_caches:
            h.update(cache.view(torch.uint8).numpy().tobytes())
        for pool in self.storage.host.groups.values():
            h.update(pool.pages.numpy().tobytes())
        return h.hexdigest()

    def ledger(self) -> dict[str, Any]:
        records, _, next_release = self.storage._verify.swaps.state  # the worker's own
        return {
            "records": {
                r: {g: (c.tolist(), p.tolist()) for g, (c, p) in rec.items()}
                for r, rec in records.items()
            },
            "next_release": next_release,
        }

    def books(self) -> dict[str, Any]:
        m = self.m
        return {
            "running": m.requests,
            "swapped": m.swapped_requests,
            "in_flight": [p.plan_id for p in m._book.plans_in_flight()],
            "host": {g: m.host_pool(g).num_used for g in m.host_groups},
            "stats": dataclasses.asdict(self.ctl.stats),
        }

    def state(self) -> tuple[Any, ...]:
        return self.worker_digest(), self.ledger(), self.books()

    def check_bytes(self, requests: list[str] | None = None) -> int:
        """Swap every swapped request in and compare every live entry; the entries seen."""
        seen = 0
        for r in requests or list(LENGTHS):
            if self.ctl.is_swapped(r):
                self.ctl.swap_in(r)
            check = verify_request(self.ctl, r, seed=list(LENGTHS).index(r))
            assert check.mismatched == 0, (r, check)
            seen += check.entries
        return seen


def flip(plan: SwapPlan, **fields: Any) -> SwapPlan:
    return dataclasses.replace(plan, direction="out" if plan.direction == "in" else "in", **fields)


def move_of(plan: SwapPlan, **fields: Any) -> SwapPlan:
    """``plan`` with its one move's fields replaced."""
    [move] = plan.requests
    return dataclasses.replace(plan, requests=(dataclasses.replace(move, **fields),))


# ---------------------------------------------------------------------- the attacks
# Each prepares with legitimate calls and returns (the attack, what settles the protocol
# afterwards). The attack must raise; the settling runs after the state was compared.

Attack = tuple[Callable[[], Any], Callable[[], Any]]


def swap_in_flipped_to_out(env: Env) -> Attack:
    # the example: a swap-in plan of a sent as a swap out (same id, same moves) would
    # copy a's fresh, unwritten blocks over its swapped pages: 256 of a's entries lost
    plan = env.m.plan_swap_in(["a"])
    env.sync()
    return (lambda: env.execute(flip(plan))), (lambda: env.swap(plan))


def swap_in_flipped_under_a_new_id(env: Env) -> Attack:
    plan = env.m.plan_swap_in(["a"])
    env.sync()
    forged = flip(plan, plan_id=env.forged_id())
    return (lambda: env.execute(forged)), (lambda: env.swap(plan))


def swap_out_flipped_to_in(env: Env) -> Attack:
    # b's swap out sent as a swap in would read its fresh, unwritten pages into its blocks
    plan = env.m.plan_swap_out(["b"])
    env.sync()
    return (lambda: env.execute(flip(plan))), (lambda: env.swap(plan))


def ok_without_receipt(env: Env) -> Attack:
    # the example: SwapResult(ok) for b's swap out, never executed, was accepted
    plan = env.m.plan_swap_out(["b"])
    return (lambda: env.m.complete_swap(SwapResult(plan.plan_id))), (lambda: env.swap(plan))


def ok_with_another_plans_receipt(env: Env) -> Attack:
    plan_b = env.m.plan_swap_out(["b"])
    result_c = env.swap(env.m.plan_swap_out(["c"]))
    assert result_c.ok
    forged = SwapResult(plan_b.plan_id, receipt=result_c.receipt)
    return (lambda: env.m.complete_swap(forged)), (lambda: env.swap(plan_b))


def ok_with_the_flipped_plans_receipt(env: Env) -> Attack:
    plan = env.m.plan_swap_in(["a"])
    forged = SwapResult(plan.plan_id, receipt=plan_receipt(flip(plan)))
    return (lambda: env.m.complete_swap(forged)), (lambda: env.swap(plan))


def swap_in_after_a_forged_ok(env: Env) -> Attack:
    # past the scheduler side (a forger who saw the plan computes its receipt): b's swap out
    # never ran, so the worker holds no data of b, and b's swap in would restore unwritten
    # pages (the 160 wrong entries)
    out = env.m.plan_swap_out(["b"])
    env.m.complete_swap(SwapResult(out.plan_id, receipt=plan_receipt(out)))
    env.sync()
    plan = env.m.plan_swap_in(["b"])
    env.sync()

    def settle() -> None:
        env.m.complete_swap(SwapResult(plan.plan_id, FAILED))
        env.sync()
        env.m.finish(["b"])  # b's bytes were lost to the forged result; the others are not
        env.sync()
        del env.lengths["b"]

    return (lambda: env.execute(plan)), settle


def swap_out_into_a_swapped_requests_pages(env: Env) -> Attack:
    plan = env.m.plan_swap_out(["c"])
    env.sync()
    a_pages = env.m._book.swapped["a"].host_pages
    [move] = plan.requests
    pages = {
        g: np.asarray(a_pages[g][: len(p)], dtype=np.int32) for g, p in move.host_pages.items()
    }
    forged = move_of(plan, host_pages=pages)
    forged = dataclasses.replace(forged, plan_id=env.forged_id())
    return (lambda: env.execute(forged)), (lambda: env.swap(plan))


def swap_in_of_pages_permuted(env: Env) -> Attack:
    plan = env.m.plan_swap_in(["a"])
    env.sync()
    [move] = plan.requests
    pages = {g: p[::-1].copy() for g, p in move.host_pages.items()}
    return (lambda: env.execute(move_of(plan, host_pages=pages))), (lambda: env.swap(plan))


def swap_in_of_another_requests_pages(env: Env) -> Attack:
    # b and a both swapped out; b's swap in names a's pages (as many as b's)
    assert env.swap(env.m.plan_swap_out(["b"])).ok
    plan = env.m.plan_swap_in(["b"])
    env.sync()
    a_pages = env.m._book.swapped["a"].host_pages
    [move] = plan.requests
    pages = {
        g: np.concatenate([a_pages[g], p])[: len(p)].astype(np.int32)
        for g, p in move.host_pages.items()
    }
    return (lambda: env.execute(move_of(plan, host_pages=pages))), (lambda: env.swap(plan))


def release_gap(env: Env) -> Attack:
    plan = env.m.plan_swap_out(["c"])
    env.sync()
    gap = PageRelease(99, "a", {"kv": np.array([1], dtype=np.int32)})
    forged = dataclasses.replace(plan, released=(gap,))
    return (lambda: env.execute(forged)), (lambda: env.swap(plan))


def swap_out_with_its_releases_stripped(env: Env) -> Attack:
    # a came back; its next swap out carries the release of its old pages: without it the
    # worker still holds a's swapped data there, and refuses
    assert env.swap(env.m.plan_swap_in(["a"])).ok
    plan = env.m.plan_swap_out(["a"])
    env.sync()
    assert [r.request_id for r in plan.released] == ["a"]
    forged = dataclasses.replace(plan, released=())
    return (lambda: env.execute(forged)), (lambda: env.swap(plan))


def swap_out_of_b_sent_as_c(env: Env) -> Attack:
    # b's blocks stored as c's swapped data: c's swap in would then restore b's KV
    plan = env.m.plan_swap_out(["b"])
    env.sync()
    forged = dataclasses.replace(move_of(plan, request_id="c"), plan_id=env.forged_id())
    return (lambda: env.execute(forged)), (lambda: env.swap(plan))


def swap_in_of_a_request_never_swapped(env: Env) -> Attack:
    plan = env.m.plan_swap_in(["a"])
    env.sync()
    forged = move_of(plan, request_id="zz")
    return (lambda: env.execute(forged)), (lambda: env.swap(plan))


def forged_move_of_unknown_request(env: Env) -> Attack:
    plan = env.m.plan_swap_in(["a"])
    env.sync()
    [move] = plan.requests
    extra = RequestMove("zz", 16, move.purpose, {}, {}, {})
    forged = dataclasses.replace(plan, requests=(move, extra))
    return (lambda: env.execute(forged)), (lambda: env.swap(plan))


ATTACKS = [
    (swap_in_flipped_to_out, PageOwnershipError, "direction flipped"),
    (swap_in_flipped_under_a_new_id, PageOwnershipError, "whose swapped data this worker holds"),
    (swap_out_flipped_to_in, BlockOwnershipError, "a step wrote"),
    (ok_without_receipt, SwapReceiptError, "without a receipt"),
    (ok_with_another_plans_receipt, SwapReceiptError, "receipt is not that of the 'out' plan"),
    (ok_with_the_flipped_plans_receipt, SwapReceiptError, "receipt is not that of the 'in'"),
    (swap_in_after_a_forged_ok, PageOwnershipError, "'b', which has no swapped data"),
    (swap_out_into_a_swapped_requests_pages, PageOwnershipError, "swapped data of request 'a'"),
    (swap_in_of_pages_permuted, PageOwnershipError, "but its swapped data is in pages"),
    (swap_in_of_another_requests_pages, PageOwnershipError, "for request 'b'"),
    (release_gap, WorkerRefusedError, "releases 0..98 never arrived"),
    (swap_out_with_its_releases_stripped, PageOwnershipError, "whose swapped data this"),
    (swap_out_of_b_sent_as_c, BlockOwnershipError, "that row serves request 'b'"),
    (swap_in_of_a_request_never_swapped, PageOwnershipError, "'zz', which has no swapped"),
    (forged_move_of_unknown_request, PageOwnershipError, "'zz', which has no swapped"),
]


@pytest.mark.parametrize(
    ("attack", "error", "fragment"), ATTACKS, ids=[a[0].__name__ for a in ATTACKS]
)
def test_swap_messages_are_checked_against_what_each_side_holds(attack, error, fragment):
    env = Env()
    run, settle = attack(env)
    before = env.state()
    with pytest.raises(error) as info:
        run()
    assert fragment in str(info.value), str(info.value)
    assert "nothing" in str(info.value)
    assert env.state() == before  # not a byte, page, table cell, record or counter moved
    settle()  # the legitimate protocol goes on
    assert env.m._book.plans_in_flight() == ()
    assert env.check_bytes(list(env.lengths)) > 0
    env.ctl.free_requests(list(env.lengths))
    assert all(used == 0 for used in env.books()["host"].values())
    # the next plan tells the worker every page given back: it holds d's data alone
    grow(env.ctl, "d", 40)
    env.ctl.swap_out("d")
    assert list(env.ledger()["records"]) == ["d"]
    env.ctl.swap_in("d")
    env.ctl.free_request("d")
