"""The worker verifies before it moves a byte (issue 20, class 5: "the worker trusts every
plan"): table tests of every refusal of ``CacheStorage.apply``, ``apply_deltas``,
``copy_blocks`` and ``execute``, each with the exception type, a fragment of its message and a
state check afterwards (every mirrored table, the next sequence number, every byte of every
device cache and host page).

The layout is gpt-oss shaped and small (as in ``tests/scheduler/test_shared_pools.py``): a
sliding-window group ``swa`` and a full group ``kv``, 16-token blocks, 20 blocks per group (the
issue's example pool), 4 table rows of 16 columns. Requests ``a`` and ``b`` hold 40 tokens,
``c`` 24; every cache byte is random, so a byte that moves anywhere shows.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

from kvforge import GQABackend
from kvforge.core.layout import CacheLayout
from kvforge.core.values import BlockCopy, PrefixQuery, RequestMove, SwapPlan, TableDelta
from kvforge.errors import (
    BlockOwnershipError,
    BlockRangeError,
    DeltaOrderError,
    PlanReplayError,
    UnissuedCopyError,
    WorkerRefusedError,
)
from kvforge.scheduler import BlockManager
from kvforge.specs import SwapPurpose
from kvforge.worker import CacheStorage
from kvforge.worker.guard import PlanLedger

BLOCKS, ROWS, MAX_LEN = 20, 4, 256  # 16 columns of 16-token blocks


def backends() -> dict[int, GQABackend]:
    swa = GQABackend(2, 8, block_size=16, sliding_window=32)
    kv = GQABackend(2, 8, block_size=16)
    return {0: swa, 1: kv, 2: swa, 3: kv}


def i32(*values: int) -> np.ndarray:
    return np.array(values, dtype=np.int32)


class Env:
    """One scheduler side and one worker side in this process, mirrored in step."""

    def __init__(self, prefix: bool = False, share: bool = False, seed: int = 0) -> None:
        self.layout = CacheLayout(backends())
        blocks = dict.fromkeys((g.name for g in self.layout.groups), BLOCKS)
        self.manager = BlockManager(
            self.layout, blocks, ROWS, MAX_LEN, enable_prefix_caching=prefix, share_pools=share
        )
        self.storage = CacheStorage(self.layout)
        self.storage.create(blocks, ROWS, MAX_LEN, share_pools=share)
        pages = dict.fromkeys(blocks, BLOCKS)
        self.manager.init_host(pages)
        self.storage.init_host(pages)
        if not prefix:
            self.step(["a", "b", "c"], [40, 40, 24])
        gen = torch.Generator().manual_seed(seed)
        for cache in self.storage.kv_caches:
            raw = cache.view(torch.uint8)
            raw.copy_(torch.randint(0, 256, raw.shape, generator=gen, dtype=torch.uint8))

    def step(self, ids: list[str], counts: list[int], **kwargs: Any) -> Any:
        step = self.manager.schedule(ids, counts, **kwargs)
        assert not step.refused, step.refused
        self.storage.apply(step)
        if step.copies_before:
            self.storage.copy_blocks(step.copies_before)
        if step.copies_after:
            self.storage.copy_blocks(step.copies_after)
        if hasattr(self.manager, "end_step"):
            self.manager.end_step(step)
        return step

    def sync(self) -> None:
        self.storage.apply_deltas(self.manager.take_table_deltas())

    def swap(self, plan: SwapPlan) -> Any:
        self.sync()
        result = self.storage.execute(plan).result
        self.manager.complete_swap(result)
        self.sync()
        return result

    @property
    def seq(self) -> int:
        return self.storage.next_seq

    def row(self, rid: str) -> int:
        return self.manager.row_of(rid)

    def blocks(self, rid: str, group: str = "kv") -> np.ndarray:
        ids = np.array(self.manager.block_table(rid, group), dtype=np.int32)
        return ids[ids != 0]

    def free_block(self, group: str = "kv") -> int:
        """A block no mirrored row holds (any group of the layout)."""
        held = set()
        for g in self.layout.groups:
            held |= set(self.storage.block_table(g.name).ravel().tolist())
        return next(b for b in range(1, BLOCKS) if b not in held)

    def snapshot(self) -> dict[str, Any]:
        return {
            "tables": {g.name: self.storage.block_table(g.name).copy() for g in self.layout.groups},
            "seq": self.storage.next_seq,
            "caches": [c.view(torch.uint8).clone() for c in self.storage.kv_caches],
            "host": [p.pages.clone() for p in self.storage.host.groups.values()],
        }

    def assert_unchanged(self, before: dict[str, Any]) -> None:
        after = self.snapshot()
        assert after["seq"] == before["seq"]
        for g, table in before["tables"].items():
            np.testing.assert_array_equal(after["tables"][g], table, err_msg=g)
        for i, (x, y) in enumerate(zip(before["caches"], after["caches"], strict=True)):
            assert torch.equal(x, y), f"cache {self.storage.names[i]} changed"
        for x, y in zip(before["host"], after["host"], strict=True):
            assert torch.equal(x, y), "host pages changed"


def refused(env: Env, call: Callable[[], Any], error: type[Exception], fragment: str) -> None:
    """``call`` raises ``error`` with ``fragment`` in its message and changes nothing."""
    before = env.snapshot()
    with pytest.raises(error) as info:
        call()
    assert fragment in str(info.value), str(info.value)
    assert isinstance(info.value, WorkerRefusedError)
    env.assert_unchanged(before)


# ====================================================================== deltas


def _delta(env: Env, offset: int = 0, **fields: Any) -> TableDelta:
    fields.setdefault("group", "kv")
    for name in ("clear_rows", "rows", "cols", "block_ids"):
        if name in fields and not isinstance(fields[name], np.ndarray):
            fields[name] = i32(*fields[name])
    return TableDelta(seq=env.seq + offset, **fields)


def _next_deltas(env: Env) -> tuple[TableDelta, ...]:
    """Real deltas of a real step (one per group), not mirrored yet."""
    deltas = env.manager.schedule(["a", "b"], [16, 16]).table_deltas
    assert len(deltas) >= 2
    return deltas


DELTA_CASES: dict[str, tuple[Callable[[Env], list[TableDelta]], type[Exception], str]] = {
    "gap": (lambda e: [_delta(e, 1)], DeltaOrderError, "a gap: delta"),
    "repeat": (lambda e: [_delta(e, -1)], DeltaOrderError, "a repeat or a reordering"),
    "never handed out": (
        lambda e: [dataclasses.replace(_delta(e), seq=-1)],
        DeltaOrderError,
        "never handed out",
    ),
    "reordered": (lambda e: list(_next_deltas(e))[::-1], DeltaOrderError, "a gap"),
    "skipped": (lambda e: list(_next_deltas(e))[1:], DeltaOrderError, "a gap"),
    "repeated in one batch": (
        lambda e: [(d := _next_deltas(e))[0], d[0]],
        DeltaOrderError,
        "a repeat or a reordering",
    ),
    "another scheduler's": (
        lambda e: list(_foreign_deltas()),
        DeltaOrderError,
        "a repeat or a reordering",
    ),
    "block id past the pool": (
        lambda e: [_delta(e, rows=[e.row("a")], cols=[0], block_ids=[10_000])],
        BlockRangeError,
        "block id 10000 of group 'kv' is outside [0, 20)",
    ),
    "negative block id": (
        lambda e: [_delta(e, rows=[e.row("a")], cols=[0], block_ids=[-1])],
        BlockRangeError,
        "block id -1 of group 'kv'",
    ),
    "row past the table": (
        lambda e: [_delta(e, rows=[ROWS], cols=[0], block_ids=[1])],
        BlockRangeError,
        "row 4 of group 'kv' is outside [0, 4)",
    ),
    "negative row": (
        lambda e: [_delta(e, rows=[-1], cols=[0], block_ids=[1])],
        BlockRangeError,
        "row -1 of group 'kv'",
    ),
    "column past the table": (
        lambda e: [_delta(e, rows=[0], cols=[16], block_ids=[1])],
        BlockRangeError,
        "column 16 of group 'kv' is outside [0, 16)",
    ),
    "negative column": (
        lambda e: [_delta(e, rows=[0], cols=[-1], block_ids=[1])],
        BlockRangeError,
        "column -1",
    ),
    "clear row past the table": (
        lambda e: [_delta(e, clear_rows=[9])],
        BlockRangeError,
        "row 9 of group 'kv'",
    ),
    "int64 ids past the pool": (
        lambda e: [_delta(e, rows=[0], cols=[0], block_ids=np.array([2**40], dtype=np.int64))],
        BlockRangeError,
        "block id 1099511627776",
    ),
    "a batch of int32 and uint64 ids, one past int64": (
        lambda e: [
            _delta(e, rows=[0], cols=[0], block_ids=[1]),
            _delta(e, 1, rows=[0], cols=[1], block_ids=np.array([2**63 + 5], dtype=np.uint64)),
        ],
        BlockRangeError,
        "block id -9223372036854775803 of group 'kv'",
    ),
    "lengths differ": (
        lambda e: [_delta(e, rows=[0, 1], cols=[0], block_ids=[1])],
        WorkerRefusedError,
        "has 2 rows, 1 cols and 1 block ids",
    ),
    "float block ids": (
        lambda e: [_delta(e, rows=[0], cols=[0], block_ids=np.array([1.0]))],
        WorkerRefusedError,
        "block_ids must be a 1-d integer array",
    ),
    "boolean clear_rows (a mask)": (
        lambda e: [_delta(e, clear_rows=np.ones(ROWS, dtype=bool))],
        WorkerRefusedError,
        "clear_rows must be a 1-d integer array",
    ),
    "unknown group": (
        lambda e: [_delta(e, group="nope")],
        WorkerRefusedError,
        "unknown group 'nope'",
    ),
    "not a delta": (lambda e: [("kv", 0)], WorkerRefusedError, "expected TableDelta values"),
    "all or nothing: a good delta, then a bad one": (
        lambda e: [
            _delta(e, rows=[e.row("a")], cols=[5], block_ids=[e.free_block()]),
            _delta(e, 1, rows=[0], cols=[0], block_ids=[10_000]),
        ],
        BlockRangeError,
        "block id 10000",
    ),
}


def _foreign_deltas() -> tuple[TableDelta, ...]:
    other = BlockManager(CacheLayout(backends()), dict(swa=BLOCKS, kv=BLOCKS), ROWS, MAX_LEN)
    return other.schedule(["x"], [16]).table_deltas


@pytest.mark.parametrize("case", sorted(DELTA_CASES))
def test_apply_deltas_refuses(case: str) -> None:
    env = Env()
    build, error, fragment = DELTA_CASES[case]
    deltas = build(env)
    if case == "gap":
        fragment = f"has seq {env.seq + 1}, expected {env.seq}: a gap: delta {env.seq} was never"
    refused(env, lambda: env.storage.apply_deltas(deltas), error, fragment)


def test_refused_deltas_can_follow_in_order_and_a_zero_id_clears_a_cell() -> None:
    env = Env()
    deltas = _next_deltas(env)
    refused(env, lambda: env.storage.apply_deltas(deltas[::-1]), DeltaOrderError, "a gap")
    env.storage.apply_deltas(deltas)  # the same deltas in their order: mirrored
    np.testing.assert_array_equal(env.storage.block_table("kv"), env.manager.table("kv"))
    row = env.row("a")
    env.storage.apply_deltas([_delta(env, rows=[row], cols=[0], block_ids=[0])])
    assert env.storage.block_table("kv")[row, 0] == 0
    with pytest.raises(DeltaOrderError, match="a repeat or a reordering"):
        env.storage.apply_deltas(deltas)


def test_apply_refuses_a_step_row_outside_the_tables_before_mirroring_its_deltas() -> None:
    env = Env()
    step = env.manager.schedule(["a"], [16])
    assert step.table_deltas
    for rows, fragment in (([-1], "apply: row -1 is outside [0, 4)"), ([ROWS], "row 4 is outside")):
        bad = dataclasses.replace(step, rows=i32(*rows))
        refused(env, lambda bad=bad: env.storage.apply(bad), BlockRangeError, fragment)
    gap = dataclasses.replace(step, table_deltas=step.table_deltas[1:])
    refused(env, lambda: env.storage.apply(gap), DeltaOrderError, "a gap")
    env.storage.apply(step)  # the real one still applies
    np.testing.assert_array_equal(env.storage.block_table("kv"), env.manager.table("kv"))


def test_apply_refuses_a_step_whose_move_writes_a_held_block_before_anything() -> None:
    """``StepAllocation.moves`` run first, checked as copies into no row: a forged move that
    writes a block some row holds refuses the whole step (nothing copied or mirrored)."""
    env = Env()
    step = env.manager.schedule(["a"], [16])
    for dst, fragment in (
        (
            env.blocks("b")[0],
            f"copy_blocks: block {env.blocks('b')[0]} of group 'kv' is held by "
            f"row {env.row('b')} (column 0), which the copy does not write for",
        ),
        (BLOCKS, f"copy_blocks: block id {BLOCKS} of group 'kv' is outside [1, {BLOCKS})"),
    ):
        bad = dataclasses.replace(step, moves=(_copy([env.blocks("c")[0]], [dst]),))
        refused(env, lambda bad=bad: env.storage.apply(bad), WorkerRefusedError, fragment)
    env.storage.apply(step)  # the real one still applies
    np.testing.assert_array_equal(env.storage.block_table("kv"), env.manager.table("kv"))


# ====================================================================== copies


def _copy(src: Any, dst: Any, row: int = -1, group: str = "kv") -> BlockCopy:
    return BlockCopy(group, i32(*src), i32(*dst), row)


COPY_CASES: dict[str, tuple[Callable[[Env], list[BlockCopy]], type[Exception], str]] = {
    "dst -1 (used to wrap to the last block)": (
        lambda e: [_copy([e.blocks("a")[0]], [-1])],
        BlockRangeError,
        "block id -1 of group 'kv' is outside [1, 20)",
    ),
    "dst the null block": (
        lambda e: [_copy([e.blocks("a")[0]], [0])],
        BlockRangeError,
        "block id 0 of group 'kv' is outside [1, 20) (0 is the null block)",
    ),
    "src past the pool": (
        lambda e: [_copy([BLOCKS], [e.free_block()])],
        BlockRangeError,
        "block id 20 of group 'kv'",
    ),
    "dst past the pool": (
        lambda e: [_copy([e.blocks("a")[0]], [10_000])],
        BlockRangeError,
        "block id 10000",
    ),
    "snapshot (row -1) into another request's block": (
        lambda e: [_copy([e.blocks("a")[0]], [e.blocks("b")[-1]])],
        BlockOwnershipError,
        "is held by row",
    ),
    "copy for a's row into b's block": (
        lambda e: [_copy([e.blocks("a")[0]], [e.blocks("b")[0]], e.row("a"))],
        BlockOwnershipError,
        "is not in row",
    ),
    "copy for a's row into a block outside it": (
        lambda e: [_copy([e.blocks("a")[0]], [e.free_block()], e.row("a"))],
        BlockOwnershipError,
        "is not in row",
    ),
    "row past the table": (
        lambda e: [_copy([e.blocks("a")[0]], [e.free_block()], 7)],
        BlockRangeError,
        "row 7 of group 'kv' is outside [-1, 4)",
    ),
    "lengths differ": (
        lambda e: [_copy([1, 2], [e.free_block()])],
        WorkerRefusedError,
        "has 2 sources and 1 destinations",
    ),
    "one block written twice": (
        lambda e: [_copy([1, 2], [e.free_block()] * 2)],
        WorkerRefusedError,
        "writes a block twice",
    ),
    "unknown group": (
        lambda e: [_copy([1], [2], group="nope")],
        WorkerRefusedError,
        "unknown group 'nope'",
    ),
    "all or nothing: a good copy, then one into b's block": (
        lambda e: [
            _copy([e.blocks("a")[0]], [e.free_block()]),
            _copy([e.blocks("a")[0]], [e.blocks("b")[0]]),
        ],
        BlockOwnershipError,
        "is held by row",
    ),
}


@pytest.mark.parametrize("case", sorted(COPY_CASES))
def test_copy_blocks_refuses(case: str) -> None:
    env = Env()
    build, error, fragment = COPY_CASES[case]
    copies = build(env)
    refused(env, lambda: env.storage.copy_blocks(copies), error, fragment)


def test_copy_blocks_runs_a_copy_only_as_an_applied_step_issued_it_and_once() -> None:
    env, _ = _prefix_env()
    src, fresh = int(env.blocks("p1")[0]), env.free_block()
    last = int(env.blocks("p2")[-1])
    # forged: a snapshot into a block no row holds, a copy within the request's own row
    for copy in (_copy([src], [fresh]), _copy([src], [last], env.row("p2"))):
        refused(env, lambda c=copy: env.storage.copy_blocks([c]), UnissuedCopyError, "no applied")
    # a truncation into p2's shared block copies it on write: issued by the effects step
    env.manager.truncate("p2", 20)
    effects = env.manager.take_effects()
    assert effects is not None and {c.group for c in effects.copies_before} == {"swa", "kv"}
    env.storage.apply(effects)
    [cow] = [c for c in effects.copies_before if c.group == "kv"]
    altered = dataclasses.replace(cow, src=cow.src + 1)
    refused(env, lambda: env.storage.copy_blocks([altered]), UnissuedCopyError, "issued block")
    env.storage.copy_blocks([cow])
    for e in env.layout.buffers_of("kv"):
        raw = env.storage.kv_caches[e.index].view(torch.uint8)
        assert torch.equal(raw[int(cow.dst[0])], raw[int(cow.src[0])])
    # a retry of the copy, or of the step that issued it, is refused and changes nothing
    refused(env, lambda: env.storage.copy_blocks([cow]), UnissuedCopyError, "already ran")
    refused(env, lambda: env.storage.apply(effects), DeltaOrderError, "a repeat")


def _prefix_env() -> tuple[Env, int]:
    """``p1`` and ``p2`` share the first two ``kv`` blocks of one 48-token prompt."""
    env = Env(prefix=True)
    tokens = list(range(100, 148))
    env.step(["p1"], [48], new_token_ids=[tokens])
    [match] = env.manager.lookup([PrefixQuery(tokens)])
    assert match.num_tokens == 32
    env.step(["p2"], [16], new_token_ids=[tokens[32:]], prefix_matches=[match])
    shared = int(env.blocks("p2")[0])
    assert shared == int(env.blocks("p1")[0])
    return env, shared


def test_a_shared_block_is_read_only() -> None:
    env, shared = _prefix_env()
    row = env.row("p2")
    copy = _copy([env.free_block()], [shared], row)
    refused(env, lambda: env.storage.copy_blocks([copy]), BlockOwnershipError, "is held by row")
    # a swap in that names the shared block (both rows hold it at that index) is refused too
    plan = _forged(env, "in", "p2", {"kv": ([0], [shared], [1])})
    refused(env, lambda: env.storage.execute(plan), BlockOwnershipError, "")


def test_a_copy_into_a_block_of_another_group_of_its_shared_pool_is_refused() -> None:
    env = Env(share=True)
    swa_block = int(env.blocks("a", "swa")[-1])
    copy = _copy([env.blocks("a")[0]], [swa_block])  # a kv copy: same bytes as swa's block
    refused(env, lambda: env.storage.copy_blocks([copy]), BlockOwnershipError, "group 'swa'")


# ====================================================================== plans


def _forged(
    env: Env,
    direction: str,
    rid: str,
    groups: dict[str, tuple[list[int], list[int], list[int]]],
    plan_id: int = 10_000,
) -> SwapPlan:
    """A plan of one move: group -> (block indices, device blocks, host pages)."""
    move = RequestMove(
        request_id=rid,
        num_tokens=40,
        purpose=SwapPurpose.PREEMPT,
        block_indices={g: np.array(v[0], dtype=np.int64) for g, v in groups.items()},
        device_blocks={g: i32(*v[1]) for g, v in groups.items()},
        host_pages={g: i32(*v[2]) for g, v in groups.items()},
    )
    return SwapPlan(plan_id, direction, (move,), tuple(groups))  # type: ignore[arg-type]


def _cols(env: Env, rid: str, group: str = "kv") -> list[int]:
    return np.flatnonzero(env.manager.table(group)[env.row(rid)]).tolist()


def _own(env: Env, rid: str, group: str = "kv") -> tuple[list[int], list[int], list[int]]:
    """``rid``'s real indices and blocks of ``group``, with fresh host pages."""
    cols = _cols(env, rid, group)
    blocks = env.manager.table(group)[env.row(rid), cols].tolist()
    return cols, blocks, list(range(1, len(cols) + 1))


PLAN_CASES: dict[str, tuple[Callable[[Env], SwapPlan], type[Exception], str]] = {
    "device block past the pool": (
        lambda e: _forged(e, "out", "a", {"kv": ([0], [10_000], [1])}),
        BlockRangeError,
        "block id 10000 of group 'kv'",
    ),
    "the null block": (
        lambda e: _forged(e, "in", "a", {"kv": ([0], [0], [1])}),
        BlockRangeError,
        "(0 is the null block)",
    ),
    "negative device block": (
        lambda e: _forged(e, "in", "a", {"kv": ([0], [-1], [1])}),
        BlockRangeError,
        "block id -1",
    ),
    "host page past the pool": (
        lambda e: _forged(e, "out", "a", {"kv": (_own(e, "a")[0], _own(e, "a")[1], [10_000] * 3)}),
        BlockRangeError,
        "host page 10000 of group 'kv' is outside [1, 20)",
    ),
    "the null host page": (
        lambda e: _forged(e, "out", "a", {"kv": ([0], [_own(e, "a")[1][0]], [0])}),
        BlockRangeError,
        "(0 is the null page)",
    ),
    "block index past the table": (
        lambda e: _forged(e, "out", "a", {"kv": ([16], [1], [1])}),
        BlockRangeError,
        "column 16",
    ),
    "swap out of blocks at shifted indices": (
        lambda e: _forged(
            e, "out", "a", {"kv": ([c + 1 for c in _own(e, "a")[0]], *_own(e, "a")[1:])}
        ),
        BlockOwnershipError,
        "no mirrored row holds its blocks",
    ),
    "swap in onto a running request's row": (
        lambda e: _forged(e, "in", "z", {"kv": _own(e, "b")}),
        BlockOwnershipError,
        "which a step wrote since the row was last emptied",
    ),
    "swap in onto blocks no row holds": (
        lambda e: _forged(e, "in", "z", {"kv": ([0], [e.free_block()], [1])}),
        BlockOwnershipError,
        "no mirrored row holds its blocks",
    ),
    "a host page written twice": (
        lambda e: _forged(e, "out", "a", {"kv": (_own(e, "a")[0], _own(e, "a")[1], [1, 1, 2])}),
        WorkerRefusedError,
        "writes a host page of group 'kv' twice",
    ),
    "lengths differ": (
        lambda e: _forged(e, "out", "a", {"kv": ([0, 1], [1], [1])}),
        WorkerRefusedError,
        "has 1 device blocks, 2 indices and 1 host pages",
    ),
    "plan id 0": (
        lambda e: _forged(e, "out", "a", {"kv": _own(e, "a")}, plan_id=0),
        PlanReplayError,
        "is not above 0",
    ),
    "unknown direction": (
        lambda e: dataclasses.replace(_forged(e, "out", "a", {"kv": _own(e, "a")}), direction="x"),
        WorkerRefusedError,
        "direction must be 'out' or 'in'",
    ),
    "a group the plan does not list": (
        lambda e: dataclasses.replace(_forged(e, "out", "a", {"kv": _own(e, "a")}), groups=()),
        WorkerRefusedError,
        "the plan does not list",
    ),
}


@pytest.mark.parametrize("case", sorted(PLAN_CASES))
def test_execute_refuses(case: str) -> None:
    env = Env()
    build, error, fragment = PLAN_CASES[case]
    plan = build(env)
    refused(env, lambda: env.storage.execute(plan), error, fragment)


def test_a_swap_in_replayed_after_completion_is_refused() -> None:
    """The issue's example: an RPC retry of a completed swap in would scatter ``c``'s pages
    into blocks that now belong to ``d``."""
    env = Env()
    out = env.manager.plan_swap_out(["c"])
    assert env.swap(out).ok
    back = env.manager.plan_swap_in(["c"])
    assert env.swap(back).ok
    old = set(env.blocks("c").tolist())
    env.manager.finish(["c"])
    env.sync()
    env.step(["d"], [24])
    assert old & set(env.blocks("d").tolist())  # d now holds c's old blocks
    refused(env, lambda: env.storage.execute(back), PlanReplayError, "already executed")
    refused(env, lambda: env.storage.execute(out), PlanReplayError, "already executed")


def test_a_swap_in_before_its_deltas_is_refused_and_runs_once_they_are_mirrored() -> None:
    env = Env()
    assert env.swap(env.manager.plan_swap_out(["c"])).ok
    plan = env.manager.plan_swap_in(["c"])
    refused(env, lambda: env.storage.execute(plan), BlockOwnershipError, "not mirrored")
    env.sync()
    result = env.storage.execute(plan).result  # its id was not spent by the refusal
    assert result.ok
    env.manager.complete_swap(result)


def test_plans_of_another_scheduler_are_refused() -> None:
    env = Env()
    assert env.swap(env.manager.plan_swap_out(["c"])).ok  # this worker executed plan 1
    other = Env(seed=1)
    other.step(["x"], [40])
    foreign = other.manager.plan_swap_out(["x"])  # plan 1 of the other scheduler
    assert foreign.plan_id == 1
    refused(env, lambda: env.storage.execute(foreign), PlanReplayError, "already executed")
    other.manager.complete_swap(other.storage.execute(foreign).result)
    other.sync()
    again = other.manager.plan_swap_in(["x"])  # plan 2 there, never executed here
    other.sync()
    refused(env, lambda: env.storage.execute(again), BlockOwnershipError, "no mirrored row holds")


def test_the_facade_rolls_a_refused_plan_back() -> None:
    from kvforge import CacheController
    from kvforge.verify import verify_request, write_request

    ctl = CacheController(backends())
    ctl.initialize_kv_cache(num_blocks=BLOCKS, max_num_seqs=ROWS, max_model_len=MAX_LEN)
    ctl.initialize_host_cache(num_pages=BLOCKS)
    ctl.allocate("a", 40)
    written = write_request(ctl, "a", seed=3, positions=range(40))
    mirror = ctl.storage.block_table("kv")
    row = ctl.scheduler.row_of("a")
    saved = mirror[row].copy()
    mirror[row] = 0  # a worker out of step with its scheduler
    with pytest.raises(BlockOwnershipError, match="no mirrored row holds"):
        ctl.swap_out("a")
    assert not ctl.is_swapped("a") and ctl.requests == ["a"]
    assert all(used == 0 for used, _ in ctl.host_pool_usage().values())
    mirror[row] = saved
    ctl.swap_out("a")
    ctl.swap_in("a")
    check = verify_request(ctl, "a", seed=3)
    assert (check.entries, check.mismatched) == (written, 0)
    ctl.free()


def test_the_ledger_folds_old_ids_into_a_floor() -> None:
    ledger = PlanLedger(keep=2)
    for plan_id in (1, 2, 3, 5, 6):
        ledger.check(plan_id)
        ledger.record(plan_id)
    assert 1 in ledger and 2 in ledger and 4 not in ledger
    ledger.check(4)  # out of order, but within the ids it still tells apart
    with pytest.raises(PlanReplayError, match="already executed"):
        ledger.check(6)
    with pytest.raises(WorkerRefusedError, match="plan_id must be an int"):
        ledger.check("7")
