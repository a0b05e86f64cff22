"""The worker's ledgers of steps and host tier pages (issue 32, classes 1 and 10): a step is
applied once and in order whatever it carries, a row serves the request the steps bound it to,
a block copy runs only as an applied step issued it, and a host tier copy runs only in its
tier's sequence against the worker's own record of which key each page holds.

Each table row is (call, exception type, message fragment); every refusal leaves every device
byte, every tier page, the mirrored tables and both ledgers as they were.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from _helpers import next_step

from kvforge import GQABackend
from kvforge.core.layout import CacheLayout
from kvforge.core.values import BlockCopy, PageCopy, StepAllocation, TableDelta
from kvforge.errors import (
    BlockOwnershipError,
    DeltaOrderError,
    PageOwnershipError,
    StepOrderError,
    UnissuedCopyError,
    WorkerRefusedError,
)
from kvforge.scheduler import BlockManager
from kvforge.worker import CacheStorage
from kvforge.worker.tier_pages import HostTierPages

BLOCKS, ROWS, MAX_LEN, PAGES = 20, 4, 256, 6


class Env:
    """A scheduler side and a worker side in step: ``a`` holds 40 tokens, ``b`` 24 (16-token
    blocks, so each may decode within its last block without a table delta)."""

    def __init__(self) -> None:
        kv = GQABackend(2, 8, block_size=16)
        self.layout = CacheLayout({0: kv, 1: kv})
        blocks = {"kv": BLOCKS}
        self.manager = BlockManager(self.layout, blocks, ROWS, MAX_LEN)
        self.storage = CacheStorage(self.layout)
        self.storage.create(blocks, ROWS, MAX_LEN, share_pools=False)
        self.tier = HostTierPages(self.storage, {"kv": PAGES})
        self.last = self.step(["a", "b"], [40, 24])
        gen = torch.Generator().manual_seed(7)
        for cache in self.storage.kv_caches:
            raw = cache.view(torch.uint8)
            raw.copy_(torch.randint(0, 256, raw.shape, generator=gen, dtype=torch.uint8))

    def step(self, ids: list[str], counts: list[int]) -> StepAllocation:
        step = self.manager.schedule(ids, counts)
        self.storage.apply(step)
        self.manager.end_step(step)
        return step

    def row(self, rid: str) -> int:
        return self.manager.row_of(rid)

    def next(self, **fields: Any) -> StepAllocation:
        """A step numbered as the worker's next one, of no request unless ``fields`` say."""
        return next_step(self.storage, **fields)

    def page_copy(
        self, blocks: list[int], pages: list[int], tags: list[int], **kw: Any
    ) -> PageCopy:
        kw.setdefault("seq", self.tier.ledger.next_seq)
        return PageCopy(
            "kv",
            np.array(blocks, np.int32),
            np.array(pages, np.int32),
            np.array(tags, np.int64),
            **kw,
        )

    def snapshot(self) -> list[Any]:
        return [
            *(c.view(torch.uint8).clone() for c in self.storage.kv_caches),
            self.tier.groups["kv"].pages.clone(),
            self.storage.block_table("kv").copy(),
            self.storage.next_step,
            self.storage.next_seq,
            self.tier.ledger.next_seq,
            self.tier.ledger.owners["kv"].copy(),
        ]


def unchanged(before: list[Any], after: list[Any]) -> bool:
    for a, b in zip(before, after, strict=True):
        same = torch.equal(a, b) if isinstance(a, torch.Tensor) else np.array_equal(a, b)
        if not same:
            return False
    return True


def refused(env: Env, call: Callable[[], Any], error: type[Exception], fragment: str) -> None:
    before = env.snapshot()
    with pytest.raises(error) as info:
        call()
    assert fragment in str(info.value), str(info.value)
    assert isinstance(info.value, WorkerRefusedError)
    assert unchanged(before, env.snapshot())


def i32(*v: int) -> np.ndarray:
    return np.array(v, np.int32)


def i64(*v: int) -> np.ndarray:
    return np.array(v, np.int64)


# ---------------------------------------------------------------------------- steps

STEPS: list[tuple[str, Callable[[Env], Callable[[], Any]], type[Exception], str]] = [
    (
        "a retry of the last step",
        lambda e: lambda: e.storage.apply(e.last),
        DeltaOrderError,
        "a repeat",
    ),
    (
        "a later step first (a gap)",
        lambda e: lambda: e.storage.apply(e.next(step_id=e.storage.next_step + 1)),
        StepOrderError,
        "a gap: step",
    ),
    (
        "a step never handed out",
        lambda e: lambda: e.storage.apply(e.next(step_id=0)),
        StepOrderError,
        "never handed out",
    ),
    (
        "a step number that is no int",
        lambda e: lambda: e.storage.apply(e.next(step_id=True)),
        StepOrderError,
        "never handed out",
    ),
    (
        "b's tokens at a's row",
        lambda e: (
            lambda: e.storage.apply(
                e.next(
                    request_ids=("b",), rows=i32(e.row("a")), num_computed=i64(24), num_new=i64(1)
                )
            )
        ),
        BlockOwnershipError,
        "which serves request 'a'",
    ),
    (
        "a new request at a's row",
        lambda e: (
            lambda: e.storage.apply(
                e.next(
                    request_ids=("z",), rows=i32(e.row("a")), num_computed=i64(0), num_new=i64(1)
                )
            )
        ),
        BlockOwnershipError,
        "which serves request 'a'",
    ),
    (
        "a at an empty row",
        lambda e: (
            lambda: e.storage.apply(
                e.next(request_ids=("a",), rows=i32(3), num_computed=i64(40), num_new=i64(1))
            )
        ),
        BlockOwnershipError,
        "it is served by row",
    ),
    (
        "one request at two rows",
        lambda e: (
            lambda: e.storage.apply(
                e.next(
                    request_ids=("z", "z"),
                    rows=i32(2, 3),
                    num_computed=i64(0, 0),
                    num_new=i64(1, 1),
                )
            )
        ),
        BlockOwnershipError,
        "it is served by row 2",
    ),
    (
        "request ids and rows of different lengths",
        lambda e: (
            lambda: e.storage.apply(
                e.next(request_ids=("a", "b"), rows=i32(0), num_computed=i64(0), num_new=i64(1))
            )
        ),
        WorkerRefusedError,
        "names 2 requests and 1 rows",
    ),
]


@pytest.mark.parametrize(("name", "make", "error", "fragment"), STEPS, ids=[s[0] for s in STEPS])
def test_a_step_is_applied_once_in_order_with_its_own_rows(name, make, error, fragment) -> None:
    env = Env()
    refused(env, make(env), error, fragment)
    env.step(["a", "b"], [1, 1])  # the real next step still applies


def test_a_step_of_page_copies_and_no_delta_is_applied_once() -> None:
    env = Env()
    block = int(env.manager.block_table("a", "kv")[0])
    offload = env.page_copy([block], [1], [77])
    step = env.next(offloads=(offload,))
    env.storage.apply(step)
    assert env.tier.ledger.owner("kv", 1) == 77
    refused(env, lambda: env.storage.apply(step), StepOrderError, "a repeat or a reordering")
    refused(env, lambda: env.tier.move([offload]), StepOrderError, "page copy number 0")


def test_a_freed_row_serves_the_next_request_it_is_given() -> None:
    env = Env()
    env.manager.finish(["a"])
    freed = env.manager.take_effects()
    assert freed is not None and freed.table_deltas
    env.storage.apply(freed)
    env.step(["c"], [16])  # the scheduler may give a's row to c now
    assert env.row("c") in (0, 1)


# ---------------------------------------------------------------------------- block copies


def test_only_issued_copies_run_and_each_once() -> None:
    env = Env()
    src = env.manager.block_table("a", "kv")[0]
    free = next(b for b in range(1, BLOCKS) if b not in env.storage.block_table("kv"))
    forged = BlockCopy("kv", i32(src), i32(free), -1)
    refused(env, lambda: env.storage.copy_blocks([forged]), UnissuedCopyError, "no applied step")
    step = env.next(copies_after=(forged,))
    env.storage.apply(step)  # the step issues it
    for altered in (
        dataclasses.replace(forged, src=i32(src + 1)),
        dataclasses.replace(forged, row=0),
        dataclasses.replace(forged, group="kv", dst=i32(free + 1)),
    ):
        refused(env, lambda a=altered: env.storage.copy_blocks([a]), WorkerRefusedError, "copy")
    env.storage.copy_blocks([forged])
    for e in env.layout.buffers_of("kv"):
        raw = env.storage.kv_caches[e.index].view(torch.uint8)
        assert torch.equal(raw[free], raw[src])
    refused(env, lambda: env.storage.copy_blocks([forged]), UnissuedCopyError, "already ran")


# ---------------------------------------------------------------------------- host tier pages


def _offloaded(env: Env) -> int:
    """Offload a's first block to page 1 under key tag 77; returns the block."""
    block = int(env.manager.block_table("a", "kv")[0])
    env.tier.move([env.page_copy([block], [1], [77])])
    return block


PAGE_COPIES: list[tuple[str, Callable[[Env, int], dict[str, Any]], type[Exception], str]] = [
    (
        "an offload into a page that holds a key",
        lambda e, b: {"offloads": [e.page_copy([b], [1], [78])]},
        PageOwnershipError,
        "holds key tag 77 and was not released",
    ),
    (
        "an onload under another key",
        lambda e, b: {"onloads": [e.page_copy([15], [1], [78])]},
        PageOwnershipError,
        "but the page holds key tag 77",
    ),
    (
        "an onload of a page that holds no key",
        lambda e, b: {"onloads": [e.page_copy([15], [2], [77])]},
        PageOwnershipError,
        "but the page holds no key",
    ),
    (
        "an onload into a live request's block",
        lambda e, b: {"onloads": [e.page_copy([b], [1], [77])]},
        BlockOwnershipError,
        "which row 0 holds",
    ),
    (
        "a replayed page copy",
        lambda e, b: {"offloads": [e.page_copy([b], [2], [79], seq=0)]},
        StepOrderError,
        "a repeat or a reordering",
    ),
    (
        "a page copy never handed out",
        lambda e, b: {"offloads": [e.page_copy([b], [2], [79], seq=-1)]},
        StepOrderError,
        "never handed out",
    ),
    (
        "two copies out of order",
        lambda e, b: {
            "offloads": [e.page_copy([b], [2], [79], seq=2), e.page_copy([b], [3], [80], seq=1)]
        },
        StepOrderError,
        "a gap",
    ),
    (
        "owners of another length",
        lambda e, b: {"offloads": [e.page_copy([b], [2], [79, 80])]},
        WorkerRefusedError,
        "every page needs the tag of the key it holds",
    ),
    (
        "owner tag 0",
        lambda e, b: {"offloads": [e.page_copy([b], [2], [0])]},
        WorkerRefusedError,
        "owner tag 0",
    ),
    (
        "a page written twice",
        lambda e, b: {"offloads": [e.page_copy([b, b], [2, 2], [79, 79])]},
        WorkerRefusedError,
        "writes a host page twice",
    ),
    (
        "a release out of range",
        lambda e, b: {"offloads": [e.page_copy([b], [2], [79], released=i32(PAGES))]},
        WorkerRefusedError,
        f"releases host page {PAGES}",
    ),
    (
        "a release of the null page",
        lambda e, b: {"offloads": [e.page_copy([b], [2], [79], released=i32(0))]},
        WorkerRefusedError,
        "releases host page 0",
    ),
]


@pytest.mark.parametrize(
    ("name", "make", "error", "fragment"), PAGE_COPIES, ids=[p[0] for p in PAGE_COPIES]
)
def test_a_page_copy_runs_only_as_the_pages_are_owned(name, make, error, fragment) -> None:
    env = Env()
    block = _offloaded(env)
    kwargs = make(env, block)
    refused(env, lambda: env.tier.move(**kwargs), error, fragment)
    # the same copy inside a step numbered as the next is refused the same way
    step = env.next(**kwargs)
    refused(env, lambda: env.storage.apply(step), error, fragment)


def test_a_released_page_takes_a_new_key_and_the_old_key_reads_nothing() -> None:
    env = Env()
    block = _offloaded(env)
    want = env.tier.groups["kv"].pages[1].clone()
    env.tier.move(onloads=[env.page_copy([15], [1], [77])])  # key 77 reads back into 15
    other = int(env.manager.block_table("b", "kv")[0])
    env.tier.move([env.page_copy([other], [1], [90], released=i32(1))])
    assert env.tier.ledger.owner("kv", 1) == 90
    assert not torch.equal(env.tier.groups["kv"].pages[1], want)
    refused(
        env,
        lambda: env.tier.move(onloads=[env.page_copy([14], [1], [77])]),
        PageOwnershipError,
        "holds key tag 90",
    )
    assert block != other


# ---------------------------------------------------------------------------- found in review


def test_a_row_a_swap_in_filled_serves_its_request() -> None:
    from kvforge import CacheController

    kv = GQABackend(2, 8, block_size=16)
    ctl = CacheController({0: kv, 1: kv})
    ctl.initialize_kv_cache(num_blocks=BLOCKS, max_num_seqs=ROWS, max_model_len=MAX_LEN)
    ctl.initialize_host_cache(num_pages=BLOCKS)
    ctl.allocate("a", 40)
    ctl.swap_out("a")
    ctl.swap_in("a")
    row = ctl.scheduler.row_of("a")
    forged = StepAllocation(("x",), i32(row), i64(0), i64(1), (), (), step_id=ctl.storage.next_step)
    before = [c.clone() for c in ctl.kv_caches]
    with pytest.raises(BlockOwnershipError, match="which serves request 'a'"):
        ctl.storage.apply(forged)
    assert all(torch.equal(a, b) for a, b in zip(before, ctl.kv_caches, strict=True))
    ctl.allocate("a", 41)  # the real next step still applies
    ctl.free()


def test_an_onload_into_a_block_the_steps_deltas_write_back_is_refused() -> None:
    env = Env()
    block = _offloaded(env)
    row = env.row("a")
    col = int(np.flatnonzero(env.storage.block_table("kv")[row] == block)[0])
    rewrite = TableDelta(
        "kv", rows=i32(row), cols=i32(col), block_ids=i32(block), seq=env.storage.next_seq
    )
    step = env.next(table_deltas=(rewrite,), onloads=(env.page_copy([block], [1], [77]),))
    refused(env, lambda: env.storage.apply(step), BlockOwnershipError, "which row")


CLAIMS = [
    ({"released": [PAGES], "pages": [2], "tags": [5]}, "released page of group 'kv' is outside"),
    ({"released": [-1], "pages": [2], "tags": [5]}, "released page of group 'kv' is outside"),
    ({"released": [], "pages": [0], "tags": [5]}, "a page of group 'kv' is outside"),
    ({"released": [], "pages": [2], "tags": [0]}, "non-zero key tags"),
    ({"released": [], "pages": [2, 3], "tags": [5]}, "non-zero key tags"),
    ({"released": [], "pages": [1], "tags": [5]}, "holds a key"),
]


@pytest.mark.parametrize(("args", "fragment"), CLAIMS)
def test_a_claim_is_checked_whole(args, fragment) -> None:
    env = Env()
    _offloaded(env)
    refused(
        env,
        lambda: env.tier.claim(
            "kv", i32(*args["released"]), i32(*args["pages"]), i64(*args["tags"])
        ),
        WorkerRefusedError,
        fragment,
    )


def test_run_takes_only_the_batch_check_passed() -> None:
    env = Env()
    block = int(env.manager.block_table("a", "kv")[0])
    onload = env.page_copy([block], [1], [77])
    refused(env, lambda: env.tier.run([], [onload]), WorkerRefusedError, "only the batch")
