"""Property test of the batched step path against an independent per-token reference model.

The model below knows nothing of the block manager's arrays: per request and per group it
keeps a dict ``block index -> block id`` of the blocks held, grows and releases them with the
window rule written token by token, and computes every slot by hand::

    slot(p) = table[(p // r) // (B // r)] * (B // r) + (p // r) % (B // r)   if p % r == r - 1
            = -1                                                               otherwise

Block ids are the pool's choice, so the model learns the id of each newly grown index from
the manager's table; everything else (which indices are held, which requests are refused,
pool usage, every slot) the model predicts and the test compares.

Window rule (per group of block size ``B``): a step of a request that held ``c`` tokens reads
from token ``start`` on: ``max(0, c + 1 - W)`` for sliding-window / state groups, ``(c // W) * W``
for chunked groups, ``0`` for full groups. Blocks wholly before ``start`` go back at that step;
every scheduled token gets a block. After a swap in a request holds only the blocks of its
resting window ``live_token_range(n)``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvforge import CacheController, DeepseekV4Backend, GQABackend
from kvforge.specs import CacheGroup, CacheRole, GroupKind


class ChunkedGQA(GQABackend):
    """GQA with chunked local attention (a window that restarts at each chunk boundary)."""

    def __init__(self, chunk: int, block_size: int) -> None:
        super().__init__(1, 8, block_size=block_size)
        group = CacheGroup(
            name="chunk", block_size=block_size, kind=GroupKind.CHUNKED, window=chunk
        )
        roles = [
            CacheRole(name=n, group="chunk", entry_shape=(1, 8), dtype="bfloat16")
            for n in ("key", "value")
        ]
        self.declare([group], roles)


def _dsv4(ratio: int) -> DeepseekV4Backend:
    return DeepseekV4Backend(ratio, head_dim=64, qk_rope_head_dim=16, index_head_dim=16)


CONFIGS = {
    # DeepSeek-V4: swa (B=64, W=128), compressed (B=256 full, r=4 and r=128),
    # c4_state (B=4, W=8), c128_state (B=8, W=128); plus GQA with a 40-token window (B=16)
    "deepseek_v4_gqa_swa": (
        lambda: {
            0: _dsv4(0),
            1: _dsv4(4),
            2: _dsv4(128),
            3: GQABackend(1, 8, block_size=16, sliding_window=40, group="gqa_swa"),
        },
        {"swa": 14, "compressed": 6, "c4_state": 60, "c128_state": 70, "gqa_swa": 20},
    ),
    # full GQA (B=16) next to a chunked group (B=8, chunk 24: chunks straddle blocks)
    "gqa_full_chunked": (
        lambda: {0: GQABackend(1, 8, block_size=16), 1: ChunkedGQA(24, 8)},
        {"kv": 30, "chunk": 14},
    ),
}


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class RefRequest:
    num_tokens: int = 0
    # group -> {block index: block id}
    blocks: dict[str, dict[int, int]] = field(default_factory=dict)


class RefModel:
    """Per-token reference: which block indices each request holds, and its slots."""

    def __init__(self, groups: list[CacheGroup], num_blocks: dict[str, int], max_seqs: int):
        self.groups = {g.name: g for g in groups}
        self.usable = {g: num_blocks[g] - 1 for g in self.groups}
        self.max_seqs = max_seqs
        self.resident: dict[str, RefRequest] = {}
        self.swapped: dict[str, int] = {}

    def used(self, group: str) -> int:
        return sum(len(r.blocks[group]) for r in self.resident.values())

    def read_start(self, g: CacheGroup, c: int) -> int:
        """First token the step that starts at token ``c`` reads."""
        if g.kind is GroupKind.FULL:
            return 0
        if g.kind is GroupKind.CHUNKED:
            return (c // g.window) * g.window
        return max(0, c + 1 - g.window)

    def rest_start(self, g: CacheGroup, n: int) -> int:
        """First token of the resting window of a request of ``n`` tokens."""
        if g.kind is GroupKind.FULL or n == 0:
            return 0
        if g.kind is GroupKind.CHUNKED:
            return ((n - 1) // g.window) * g.window
        return max(0, n - g.window)

    def plan(self, req: RefRequest, new: int) -> dict[str, tuple[list[int], list[int]]]:
        """Per group: (indices released, indices grown) by a step of ``new`` tokens."""
        out = {}
        c = req.num_tokens
        for name, g in self.groups.items():
            b = g.block_size
            held = req.blocks.get(name, {})
            start = self.read_start(g, c)
            # a block is released when every token of it lies before ``start``
            released = sorted(i for i in held if (i + 1) * b <= start)
            grown = list(range(_cdiv(c, b), _cdiv(c + new, b)))
            out[name] = (released, grown)
        return out

    def step(self, ids: list[str], new: list[int], max_model_len: int) -> list[str]:
        """Predict which requests of a batch are accepted (in order, all or nothing each)."""
        free_rows = self.max_seqs - len(self.resident)
        free = {g: self.usable[g] - self.used(g) for g in self.groups}
        accepted = []
        fresh_seen = 0
        for rid, n in zip(ids, new, strict=True):
            req = self.resident.get(rid)
            if req is None:
                fresh_seen += 1
                if fresh_seen > free_rows:
                    continue
                req = RefRequest(blocks={g: {} for g in self.groups})
            if req.num_tokens + n > max_model_len:
                continue
            plan = self.plan(req, n)
            if any(len(grown) > free[g] + len(rel) for g, (rel, grown) in plan.items()):
                continue
            for g, (rel, grown) in plan.items():
                free[g] += len(rel) - len(grown)
            accepted.append(rid)
        return accepted


def _check_invariants(ctl: CacheController, model: RefModel) -> None:
    manager = ctl.scheduler
    assert sorted(model.resident) == manager.requests
    assert sorted(model.swapped) == manager.swapped_requests
    for name in model.groups:
        table = manager.table(name)
        # the worker's mirror equals the scheduler's table
        np.testing.assert_array_equal(ctl.storage.block_table(name), table)
        assert manager.num_used_blocks(name) == model.used(name)
        seen: list[int] = []
        expected = np.zeros_like(table)
        for rid, req in model.resident.items():
            row = manager.row_of(rid)
            for idx, bid in req.blocks[name].items():
                expected[row, idx] = bid
                seen.append(bid)
        np.testing.assert_array_equal(table, expected)
        assert 0 not in seen
        assert len(seen) == len(set(seen)), f"a block of {name!r} is held twice"
    for rid, req in model.resident.items():
        assert manager.num_tokens(rid) == req.num_tokens
    for rid, n in model.swapped.items():
        assert manager.num_tokens(rid) == n


def _expected_slots(model: RefModel, group: str, ratio: int, ids, befores, news) -> np.ndarray:
    g = model.groups[group]
    per_block = g.block_size // ratio
    out = []
    for rid, c, n in zip(ids, befores, news, strict=True):
        table = model.resident[rid].blocks[group]
        for p in range(c, c + n):
            if p % ratio == ratio - 1:
                e = p // ratio
                out.append(table[e // per_block] * per_block + e % per_block)
            else:
                out.append(-1)
    return np.array(out, dtype=np.int64)


def _do_step(ctl: CacheController, model: RefModel, ids: list[str], new: list[int]) -> None:
    manager = ctl.scheduler
    expected = model.step(ids, new, manager.max_model_len)
    befores_all = {
        rid: model.resident[rid].num_tokens if rid in model.resident else 0 for rid in ids
    }
    tables_before = {
        rid: {g: dict(r.blocks[g]) for g in model.groups} for rid, r in model.resident.items()
    }
    step = ctl.schedule(ids, new)
    alloc = step.allocation
    assert list(alloc.request_ids) == expected
    assert [r.request_id for r in alloc.refused] == [r for r in ids if r not in expected]
    counts = dict(zip(ids, new, strict=True))
    assert alloc.num_computed.tolist() == [befores_all[r] for r in expected]
    assert alloc.num_new.tolist() == [counts[r] for r in expected]
    # advance the model: release, then grow with the ids the manager chose
    for rid in expected:
        req = model.resident.setdefault(rid, RefRequest(blocks={g: {} for g in model.groups}))
        plan = model.plan(req, counts[rid])
        row = manager.row_of(rid)
        for g, (released, grown) in plan.items():
            for i in released:
                del req.blocks[g][i]
            table = manager.table(g)
            for i in grown:
                req.blocks[g][i] = int(table[row, i])
        req.num_tokens += counts[rid]
    # refused requests changed nothing
    for rid in ids:
        if rid in expected:
            continue
        if rid in tables_before:
            assert {g: dict(model.resident[rid].blocks[g]) for g in model.groups} == (
                tables_before[rid]
            )
            assert manager.num_tokens(rid) == befores_all[rid]
        else:
            assert rid not in manager.requests
    _check_invariants(ctl, model)
    # every scheduled token's slot, per (group, ratio)
    inputs = step.inputs
    for (group, ratio), slots in inputs.slot_mappings.items():
        want = _expected_slots(
            model,
            group,
            ratio,
            expected,
            [befores_all[r] for r in expected],
            [counts[r] for r in expected],
        )
        np.testing.assert_array_equal(np.asarray(slots), want, err_msg=f"{group} r={ratio}")
    ctl.end_step(step)  # the step's kernels ran: the engine's order before a swap or truncate


def _truncate(ctl: CacheController, model: RefModel, rid: str, to: int) -> None:
    req = model.resident[rid]
    refused = any(
        g.kind is not GroupKind.FULL
        and req.blocks[name]
        and _cdiv(to, g.block_size) <= min(req.blocks[name])
        for name, g in model.groups.items()
    )
    below_rest = any(
        req.blocks[name] and model.rest_start(g, to) // g.block_size < min(req.blocks[name])
        for name, g in model.groups.items()
    )
    if below_rest and not refused:
        # accepted by truncate, but the resting window then starts in a released block, which
        # a swap in allocates again: not driven here, pinned by
        # tests/properties/test_soak.py::test_truncate_into_released_window_then_swap_in
        return
    if refused:
        with pytest.raises(ValueError, match="cannot truncate"):
            ctl.truncate(rid, to)
    else:
        ctl.truncate(rid, to)
        for name, g in model.groups.items():
            for i in [i for i in req.blocks[name] if i >= _cdiv(to, g.block_size)]:
                del req.blocks[name][i]
        req.num_tokens = to
    _check_invariants(ctl, model)


def _swap_out(ctl: CacheController, model: RefModel, rids: list[str]) -> None:
    ctl.swap_out_many(rids)
    for rid in rids:
        model.swapped[rid] = model.resident.pop(rid).num_tokens
    _check_invariants(ctl, model)


def _swap_in(ctl: CacheController, model: RefModel, rids: list[str]) -> None:
    manager = ctl.scheduler
    ctl.swap_in_many(rids)
    for rid in rids:
        n = model.swapped.pop(rid)
        req = RefRequest(num_tokens=n, blocks={g: {} for g in model.groups})
        row = manager.row_of(rid)
        for name, g in model.groups.items():
            table = manager.table(name)
            for i in range(model.rest_start(g, n) // g.block_size, _cdiv(n, g.block_size)):
                req.blocks[name][i] = int(table[row, i])
        model.resident[rid] = req
    _check_invariants(ctl, model)


def _finish(ctl: CacheController, model: RefModel, rids: list[str]) -> None:
    ctl.free_requests(rids)
    for rid in rids:
        model.resident.pop(rid, None)
        model.swapped.pop(rid, None)
    _check_invariants(ctl, model)


def run_scenario(config: str, data: st.DataObject, num_ops: int) -> None:
    make, num_blocks = CONFIGS[config]
    ctl = CacheController(make())
    max_seqs = 5
    ctl.initialize_kv_cache(num_blocks=num_blocks, max_num_seqs=max_seqs, max_model_len=1024)
    ctl.initialize_host_cache(num_pages=200)
    model = RefModel([ctl.layout.group(g) for g in ctl.groups], num_blocks, max_seqs)
    _check_invariants(ctl, model)
    next_id = 0
    for _ in range(num_ops):
        op = data.draw(
            st.sampled_from(["step", "step", "step", "truncate", "swap_out", "swap_in", "finish"])
        )
        if op == "step":
            ids = data.draw(
                st.lists(st.sampled_from(sorted(model.resident)), unique=True)
                if model.resident
                else st.just([])
            )
            for _ in range(data.draw(st.integers(0, 2))):
                ids.append(f"r{next_id}")
                next_id += 1
            ids = data.draw(st.permutations(ids)) if ids else ids
            # a decode or a prefill chunk; zero-token steps only for empty requests here (the
            # reference model reads from the first scheduled token); the soak covers steps of
            # no tokens for running requests
            new = []
            for rid in ids:
                low = 0 if rid not in model.resident or not model.resident[rid].num_tokens else 1
                new.append(data.draw(st.one_of(st.integers(low, 2), st.integers(1, 160))))
            _do_step(ctl, model, ids, new)
        elif op == "truncate" and any(r.num_tokens > 1 for r in model.resident.values()):
            rid = data.draw(
                st.sampled_from(sorted(r for r, q in model.resident.items() if q.num_tokens > 1))
            )
            n = model.resident[rid].num_tokens
            _truncate(ctl, model, rid, data.draw(st.integers(max(1, n - 20), n)))
        elif op == "swap_out" and model.resident:
            rids = data.draw(
                st.lists(
                    st.sampled_from(sorted(model.resident)), min_size=1, max_size=2, unique=True
                )
            )
            _swap_out(ctl, model, rids)
        elif op == "swap_in" and model.swapped:
            rids = data.draw(
                st.lists(
                    st.sampled_from(sorted(model.swapped)), min_size=1, max_size=2, unique=True
                )
            )
            need = {g: 0 for g in model.groups}
            for rid in rids:
                n = model.swapped[rid]
                for name, g in model.groups.items():
                    need[name] += _cdiv(n, g.block_size) - model.rest_start(g, n) // g.block_size
            fits = len(model.resident) + len(rids) <= max_seqs and all(
                need[g] <= model.usable[g] - model.used(g) for g in model.groups
            )
            if fits:
                _swap_in(ctl, model, rids)
            else:
                with pytest.raises(Exception, match="swap_in"):
                    ctl.swap_in_many(rids)
                _check_invariants(ctl, model)
        elif op == "finish" and (model.resident or model.swapped):
            every = sorted(model.resident) + sorted(model.swapped)
            _finish(
                ctl,
                model,
                data.draw(st.lists(st.sampled_from(every), min_size=1, max_size=3, unique=True)),
            )
    _finish(ctl, model, sorted(model.resident) + sorted(model.swapped))
    for name in model.groups:
        assert ctl.num_free_blocks(name) == num_blocks[name] - 1
        assert ctl.num_used_blocks(name) == 0
    for _, (used, _usable) in ctl.host_pool_usage().items():
        assert used == 0
    ctl.free()


@pytest.mark.soak
@pytest.mark.parametrize("config", sorted(CONFIGS))
@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(data=st.data())
def test_batched_steps_match_reference(config: str, data: st.DataObject) -> None:
    run_scenario(config, data, num_ops=25)


def test_reference_model_arithmetic_by_hand() -> None:
    """The model's rules on numbers a reader can check: swa W=128, B=64."""
    swa = CacheGroup(name="swa", block_size=64, kind=GroupKind.SLIDING_WINDOW, window=128)
    model = RefModel([swa], {"swa": 20}, 4)
    req = RefRequest(num_tokens=300, blocks={"swa": {2: 7, 3: 8, 4: 9}})
    # a decode step at c=300 reads from 300 + 1 - 128 = 173: block 2 (128..191) stays
    assert model.plan(req, 1) == {"swa": ([], [])}
    req.num_tokens = 320
    # c=320 reads from 193: block 2 (tokens 128..191) is wholly before it
    assert model.plan(req, 1) == {"swa": ([2], [5])}
    chunk = CacheGroup(name="c", block_size=8, kind=GroupKind.CHUNKED, window=24)
    assert RefModel([chunk], {"c": 9}, 1).read_start(chunk, 50) == 48
    assert RefModel([chunk], {"c": 9}, 1).rest_start(chunk, 48) == 24
