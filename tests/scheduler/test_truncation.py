"""Truncation and copy on write (:mod:`kvforge.scheduler.truncation`): bad input is refused
with nothing changed, a shared block the new end falls in is copied (or refused when no pool
has a block for the copy), and blocks past the new end go back with their deltas.

Block arithmetic: group ``kv`` has 16-token blocks; group ``swa`` 64-token blocks and a window
of 128 tokens. The sharing cases use ``kv`` alone, so that a prefix hit ends on any multiple of
16 tokens.
"""

from __future__ import annotations

import numpy as np
import pytest
from _helpers import sweep_lines

from kvforge import DeepseekV4Backend, GQABackend
from kvforge.core.layout import CacheLayout
from kvforge.core.values import PrefixQuery
from kvforge.errors import OutOfBlocksError, RequestStateError
from kvforge.scheduler import BlockManager, truncation
from kvforge.scheduler.block_pool import NULL_BLOCK


def manager(kv: int = 40, swa: int = 40, prefix: bool = False, window: bool = True) -> BlockManager:
    backends = {0: GQABackend(2, 8, 16), 1: DeepseekV4Backend(0)}
    layout = CacheLayout(backends if window else {0: backends[0]})
    counts = {g.name: (kv if g.name == "kv" else swa) for g in layout.groups}
    return BlockManager(layout, counts, 4, 2048, enable_prefix_caching=prefix)


def state(m: BlockManager) -> tuple:
    t = m._t
    return (
        [g.table.tolist() for g in t.groups],
        [g.held_from.tolist() for g in t.groups],
        t.num_tokens.tolist(),
        t.committed.tolist(),
        [(g.pool.num_free, g.pool.ref_counts.tolist()) for g in t.groups],
        len(t.pending),
        len(t.copies),
    )


def grown(tokens: int, **kw) -> BlockManager:
    m = manager(**kw)
    m.end_step(m.schedule(["r"], [tokens], new_token_ids=[np.arange(tokens)]))
    m.take_table_deltas()
    return m


BAD_TRUNCATIONS = [
    # (num_tokens, exception, message fragment); the request holds 300 tokens
    (0, ValueError, r"num_tokens must be an int in \[1, 300\] for request 'r', got 0"),
    (301, ValueError, r"in \[1, 300\] for request 'r', got 301"),
    (True, ValueError, "got True"),
    (12.0, ValueError, "got 12.0"),
    ("12", ValueError, "got '12'"),
    # swa released the blocks before token 128 when the request took its next step
    (100, ValueError, r"group 'swa' already released the blocks before token 128"),
]


@pytest.mark.parametrize(("num_tokens", "exc", "fragment"), BAD_TRUNCATIONS)
def test_a_bad_truncation_is_refused_and_changes_nothing(num_tokens, exc, fragment):
    m = grown(299)
    m.end_step(m.schedule(["r"], [1]))  # token 299 reads 172..299: swa blocks 0, 1 go
    m.take_table_deltas()
    before = state(m)
    with pytest.raises(exc, match=fragment):
        m.truncate("r", num_tokens)
    with pytest.raises(exc, match=fragment):
        truncation.check_truncation(m._t, "r", m.row_of("r"), num_tokens)
    assert state(m) == before


def test_a_truncation_of_an_unknown_or_busy_request_is_refused():
    m = grown(40)
    with pytest.raises(RequestStateError, match="'x' has no blocks on the device"):
        m.truncate("x", 1)
    step = m.schedule(["r"], [1])
    before = state(m)
    with pytest.raises(RequestStateError, match=f"end_step\\({step.step_id}\\) before"):
        m.truncate("r", 10)
    assert state(m) == before


def test_truncation_frees_the_blocks_past_the_new_end_and_records_their_cells():
    m = grown(100)  # kv: 7 blocks (cols 0..6); swa: 2 blocks
    row = m.row_of("r")
    kv = m._t.by_name["kv"]
    tail = kv.table[row, 3:7].tolist()
    m.truncate("r", 40)  # kv keeps cdiv(40, 16) = 3 blocks, swa keeps 1
    assert m.num_tokens("r") == 40
    assert kv.table[row, 3:7].tolist() == [NULL_BLOCK] * 4
    assert m.num_used_blocks("kv") == 3 and m.num_used_blocks("swa") == 1
    assert all(kv.pool.ref_counts[b] == 0 for b in tail)
    deltas = {d.group: d for d in m.take_table_deltas()}
    assert deltas["kv"].cols.tolist() == [3, 4, 5, 6]
    assert deltas["kv"].block_ids.tolist() == [0, 0, 0, 0]
    assert deltas["kv"].rows.tolist() == [row] * 4
    assert deltas["swa"].cols.tolist() == [1]
    assert m.take_copies() == ()  # no block was shared


def test_release_tail_caps_the_committed_blocks_at_the_whole_blocks_kept():
    m = grown(64, prefix=True)  # kv: 4 whole blocks committed at the step's end
    t, row = m._t, m.row_of("r")
    gi = next(i for i, g in enumerate(t.groups) if g.spec.name == "kv")
    assert t.committed[gi, row] == 4
    truncation.release_tail(t, row, 64, 40)  # 2 whole blocks and a partial one kept
    assert t.committed[gi, row] == 2 and t.num_tokens[row] == 40


def _sharing(kv: int) -> tuple[BlockManager, int]:
    """``a`` caches 48 tokens; ``b`` adopts the 32-token hit, sharing kv blocks 0 and 1."""
    m = manager(kv=kv, prefix=True, window=False)  # boundaries every 16 tokens
    m.end_step(m.schedule(["a"], [48], new_token_ids=[np.arange(48)]))
    [match] = m.lookup([PrefixQuery(np.arange(48))])
    assert match.num_tokens == 32
    m.end_step(m.schedule(["b"], [16], new_token_ids=[np.arange(32, 48)], prefix_matches=[match]))
    m.take_table_deltas()
    m.take_copies()
    return m, m._t.by_name["kv"].table[m.row_of("b"), 1]


def test_copy_on_write_gives_the_truncated_request_its_own_copy_of_a_shared_block():
    m, shared = _sharing(kv=40)
    kv = m._t.by_name["kv"]
    row_a, row_b = m.row_of("a"), m.row_of("b")
    assert kv.table[row_a, 1] == shared and kv.pool.ref_counts[shared] == 2
    m.truncate("b", 20)  # token 20 falls in block 1, which a shares
    fresh = int(kv.table[row_b, 1])
    assert fresh not in (shared, NULL_BLOCK) and kv.table[row_a, 1] == shared
    assert kv.pool.ref_counts[shared] == 1 and kv.pool.ref_counts[fresh] == 1
    copies = [c for c in m.take_copies() if c.group == "kv"]
    assert len(copies) == 1
    assert copies[0].src.tolist() == [shared] and copies[0].dst.tolist() == [fresh]
    cells = [
        (int(r), int(c), int(v))
        for d in m.take_table_deltas()
        if d.group == "kv"
        for r, c, v in zip(d.rows, d.cols, d.block_ids, strict=True)
    ]
    assert (row_b, 1, fresh) in cells and (row_b, 2, 0) in cells


def test_copy_on_write_is_refused_when_no_block_is_free_and_nothing_changes():
    m, shared = _sharing(kv=5)  # 4 usable: a holds 3, b one of its own: none free
    kv = m._t.by_name["kv"]
    assert kv.pool.num_free == 0 and kv.pool.ref_counts[shared] == 2
    before = state(m)
    with pytest.raises(OutOfBlocksError, match="kv"):
        m.truncate("b", 20)
    assert state(m) == before and m.num_tokens("b") == 48


def _stacks(m: BlockManager) -> tuple:
    """The pools' free stacks (the order of later takes) and evictable blocks."""
    pools = {id(g.pool): g.pool for g in m._t.groups}.values()
    return tuple((p._stack[: p._num_free].tolist(), list(p._evictable)) for p in pools)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("build", "num_tokens"),
    [
        (lambda: _sharing(kv=40)[0], 20),  # a copy on write of the block a shares
        (lambda: grown(300), 200),  # blocks past the end, a window group's among them
        (lambda: grown(300, prefix=True), 150),  # the new end's cached key goes too
    ],
    ids=["copy-on-write", "tail", "cached-tail"],
)
def test_a_truncation_rolls_back_under_an_interrupt_at_every_line(build, num_tokens):
    """The copies on write and the releases of a truncation run under the undo journal: an
    interrupt at any line of kvforge leaves the tables, counts, pools (free stacks in order
    included), queued copies and deltas as before, and a retry then truncates as an
    uninterrupted call does; or the truncation completed."""
    request = "b" if "b" in build().requests else "r"

    def view(m: BlockManager) -> tuple:
        return state(m), _stacks(m), m.num_tokens(request)

    outcomes = sweep_lines(build, lambda m: m.truncate(request, num_tokens), view)
    assert outcomes["rolled back"] > 40 and outcomes["completed"] >= 1, outcomes
