"""Isolation: no call order, thread timing or forged match lets one request touch another's KV.

Classes of issue 20 covered here (the worker's own checks are in tests/worker/): blocks are
shared only once the step that writes them has ended; the step protocol (ids, stale, repeated
and unknown end_step, one step in flight); pins that live until their step ends; a match
used twice with one refusal leaks nothing; matches that were forged, altered or made by
another controller are refused; every public method of each side and of the facade holds
its object's lock, or is listed here as lock-free with the reason.
"""

from __future__ import annotations

import dataclasses
import inspect

import numpy as np
import pytest

from kvforge import CacheController, GQABackend, PrefixQuery
from kvforge.attn_backends.linear_attention import LinearAttentionBackend
from kvforge.core.layout import CacheLayout
from kvforge.errors import RequestStateError, StepError
from kvforge.scheduler import BlockManager
from kvforge.scheduler.block_manager import MAX_OPEN_STEPS


def manager(**kw) -> BlockManager:
    layout = CacheLayout({0: GQABackend(2, 8, 16)})
    return BlockManager(layout, {"kv": 64}, 8, 512, enable_prefix_caching=True, **kw)


def prompt(n: int, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).integers(0, 30_000, n).tolist()


# ------------------------------------------------------------------ sharing starts at end_step


def test_blocks_are_shared_only_after_the_step_that_writes_them_ends():
    m = manager()
    a = prompt(100)
    step = m.schedule(["a"], [100], new_token_ids=[a])
    # the step's kernels have not written a's blocks yet: nothing may be served from them
    assert m.lookup([PrefixQuery([*a, 1])])[0].num_tokens == 0
    assert m.take_events() == []
    m.end_step(step)
    assert m.lookup([PrefixQuery([*a, 1])])[0].num_tokens == 96
    assert [e.num_tokens for e in m.take_events()] == [16, 32, 48, 64, 80, 96]


def test_an_asynchronous_engine_may_schedule_one_step_ahead():
    m = manager()
    a = prompt(64)
    s1 = m.schedule(["a"], [32], new_token_ids=[a[:32]])
    s2 = m.schedule(["a"], [32], new_token_ids=[a[32:]])  # step 1 is still in flight
    assert m.open_steps == [s1.step_id, s2.step_id]
    m.end_step(s1)
    assert m.lookup([PrefixQuery([*a, 1])])[0].num_tokens == 32  # step 2 is not done
    m.end_step(s2)
    assert m.lookup([PrefixQuery([*a, 1])])[0].num_tokens == 64
    # steps end in any order (threads); past MAX_OPEN_STEPS the oldest open step is dropped:
    # it registers nothing, gives back what it held, and its late end_step is refused
    b = prompt(16 * (MAX_OPEN_STEPS + 1), seed=1)
    steps = [
        m.schedule([f"b{i}"], [16], new_token_ids=[b[16 * i : 16 * i + 16]])
        for i in range(MAX_OPEN_STEPS + 1)
    ]
    with pytest.raises(StepError, match=f"step {steps[0].step_id} already ended"):
        m.end_step(steps[0])
    for s in reversed(steps[1:]):
        m.end_step(s)
    assert m.open_steps == []
    assert m.lookup([PrefixQuery([*b[:16], 1])])[0].num_tokens == 0  # b0 was dropped
    assert m.lookup([PrefixQuery([*b[16:32], 1])])[0].num_tokens == 16


@pytest.mark.parametrize(
    ("step", "exception", "message"),
    [
        (99, StepError, "step 99 is unknown: this scheduler issued steps 1..1"),
        (0, StepError, "step 0 is unknown"),
        ("1", StepError, "end_step takes a StepAllocation or its step_id, got str"),
        (True, StepError, "got bool"),
    ],
)
def test_bad_end_step_changes_nothing(step, exception, message):
    m = manager()
    a = prompt(40)
    s = m.schedule(["a"], [40], new_token_ids=[a])
    with pytest.raises(exception, match=message):
        m.end_step(step)
    assert m.open_steps == [s.step_id]
    m.end_step(s)
    with pytest.raises(StepError, match="already ended"):
        m.end_step(s)  # twice
    assert m.open_steps == []


def test_the_facade_refuses_a_stale_step_before_any_copy_runs():
    ctl = CacheController({0: GQABackend(1, 8, 16)}, enable_prefix_caching=True)
    ctl.initialize_kv_cache(num_blocks=32)
    step = ctl.schedule(["a"], [20], new_token_ids=[prompt(20)])
    ctl.end_step(step)
    with pytest.raises(StepError, match="already ended"):
        ctl.end_step(step)
    with pytest.raises(StepError, match="takes a ScheduledStep"):
        ctl.end_step(step.allocation)


IN_OPEN_STEP = "is in step {step}, which has not ended; end_step({step}) before it is"


def _open_step_controller():
    ctl = CacheController({0: GQABackend(1, 8, 16)}, enable_prefix_caching=True)
    ctl.initialize_kv_cache(num_blocks=32, max_num_seqs=4, max_model_len=256)
    ctl.initialize_host_cache(num_pages=32)
    ctl.end_step(ctl.schedule(["a", "b"], [40, 40], new_token_ids=[prompt(40), prompt(40, 1)]))
    step = ctl.schedule(["a"], [8], new_token_ids=[prompt(8, 2)])  # a's kernels in flight
    return ctl, step


def _state(ctl):
    m = ctl.scheduler
    return (
        m.requests,
        m.swapped_requests,
        {r: ctl.num_tokens(r) for r in m.requests},
        {g: (ctl.num_used_blocks(g), m.table(g).tobytes()) for g in ctl.groups},
        m.open_steps,
        ctl.host_pool_usage(),
    )


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda c: c.swap_out("a"), "swapped out"),
        (lambda c: c.swap_out_many(["b", "a"]), "swapped out"),
        (lambda c: c.scheduler.plan_swap_out(["a"]), "swapped out"),
        (lambda c: c.truncate("a", 41), "truncated"),
        (lambda c: c.scheduler.truncate("a", 20), "truncated"),
    ],
)
def test_a_request_in_an_open_step_is_not_swapped_out_or_truncated(call, message):
    """Its step's kernels may still be writing its blocks: a swap out would store bytes not
    yet written and a truncation would hand back blocks still being written."""
    ctl, step = _open_step_controller()
    before = _state(ctl)
    with pytest.raises(RequestStateError) as info:
        call(ctl)
    sid = step.allocation.step_id
    assert str(info.value) == f"request 'a' {IN_OPEN_STEP.format(step=sid)} {message}"
    assert _state(ctl) == before
    ctl.end_step(step)  # once the step ended, the same call goes through
    call(ctl)


def test_a_request_outside_the_open_step_and_a_free_are_not_refused():
    ctl, step = _open_step_controller()
    ctl.swap_out("b")  # not in the open step
    ctl.swap_in("b")
    ctl.free_request("a")  # an abort: what the step held stays held until it ends
    assert ctl.scheduler.open_steps == [step.allocation.step_id]
    ctl.end_step(step)
    assert ctl.scheduler.open_steps == []
    ctl.free_request("b")
    ctl.scheduler.reset_prefix_cache()
    assert ctl.num_used_blocks("kv") == 0


# ------------------------------------------------------------------ pins live until the step ends


def linear_controller(max_num_seqs: int = 8) -> CacheController:
    linear = LinearAttentionBackend(2, 2, 8, 8, 4)
    ctl = CacheController({0: linear, 1: GQABackend(1, 8, 16)}, enable_prefix_caching=True)
    ctl.initialize_kv_cache(num_blocks={"linear_state": 8, "kv": 120}, max_num_seqs=max_num_seqs)
    return ctl


def test_a_snapshot_copy_after_the_next_schedule_never_lands_in_another_request():
    ctl = linear_controller()
    a = prompt(512)
    for done in range(0, 512, 128):
        step = ctl.schedule(["a"], [128], new_token_ids=[a[done : done + 128]])
        if done + 128 < 512:
            ctl.end_step(step)
    [copy] = step.allocation.copies_after  # the snapshot at 512, not yet run
    ctl.free_request("a")
    # an asynchronous engine schedules the next step before ending this one: new requests
    # take slots, but never the snapshot's source or destination, which the step still holds
    nxt = ctl.schedule([f"r{i}" for i in range(5)], [1] * 5, new_token_ids=[[1]] * 5)
    taken = {b for i in range(5) for b in ctl.block_table(f"r{i}", "linear_state")}
    assert not taken & (set(copy.src.tolist()) | set(copy.dst.tolist()))
    ctl.end_step(step)
    ctl.end_step(nxt)


def test_a_match_used_twice_with_one_refusal_leaks_nothing():
    ctl = linear_controller(max_num_seqs=1)
    a = prompt(600)
    for done in range(0, 600, 128):
        ctl.end_step(
            ctl.schedule(["a"], [min(128, 600 - done)], new_token_ids=[a[done : done + 128]])
        )
    ctl.free_request("a")
    [match] = ctl.lookup([PrefixQuery([*a, 5])])
    assert match.num_tokens == 512
    # n > 1 sampling: one match for two requests in one batch; b2 finds no free row
    step = ctl.schedule(
        ["b1", "b2"], [10, 10], new_token_ids=[a[512:522]] * 2, prefix_matches=[match, match]
    )
    assert [r.request_id for r in step.allocation.refused] == ["b2"]
    ctl.end_step(step)
    ctl.free_request("b1")
    ctl.scheduler.reset_prefix_cache()
    for g in ctl.groups:  # every block is back: nothing held by a dropped pin
        assert ctl.num_used_blocks(g) == 0, g


# ------------------------------------------------------------------ forged matches


def forged(match, **changes):
    return dataclasses.replace(match, **changes)


@pytest.mark.parametrize(
    "change",
    [
        lambda m: forged(m, num_tokens=m.num_tokens + 16),
        lambda m: forged(m, num_tokens=16),
        lambda m: forged(m, first_col={"kv": 1}),
        lambda m: forged(m, blocks={"kv": m.blocks["kv"][::-1].copy()}),
        lambda m: forged(m, keys={"kv": m.keys["kv"][:-1]}),
        lambda m: forged(m, seal=b"\0" * 16),
        lambda m: forged(m, hasher=m.hasher.at_prefix(0)),
    ],
)
def test_a_match_that_is_not_what_the_lookup_made_is_refused(change):
    m = manager()
    a = prompt(80)
    m.end_step(m.schedule(["a"], [80], new_token_ids=[a]))
    [match] = m.lookup([PrefixQuery([*a, 1])])
    assert match.num_tokens == 80
    bad = change(match)
    used = m.num_used_blocks("kv")
    step = m.schedule(["b"], [1], new_token_ids=[[1]], prefix_matches=[bad])
    [refusal] = step.refused
    assert refusal.reason == "stale_prefix" and "look it up again" in refusal.message
    assert m.num_used_blocks("kv") == used and not m.is_running("b")
    m.end_step(step)


def test_another_controllers_match_is_refused():
    a = prompt(80)
    one, two = manager(), manager()
    for m in (one, two):
        m.end_step(m.schedule(["a"], [80], new_token_ids=[a]))
    [match] = one.lookup([PrefixQuery([*a, 1])])
    step = two.schedule(["b"], [1], new_token_ids=[[1]], prefix_matches=[match])
    assert [r.reason for r in step.refused] == ["stale_prefix"]
    assert "another scheduler" in step.refused[0].message


# ------------------------------------------------------------------ every public method is locked

#: public callables that take no lock, and why that is safe
LOCK_FREE = {
    BlockManager: {
        "prefix_caching": "fixed at construction",
        "prefix_unit": "fixed at construction",
        "groups": "fixed at construction",
        "pool": "returns a pool object fixed at construction",
        "num_usable_blocks": "a pool's size never changes",
        "prefix_cache": "returns the prefix cache object fixed at construction",
        "group_tables": "the group tables are built at construction and never replaced",
        "last_step": "one read of a frozen value that one statement replaces",
    },
    CacheController: {
        "platform": "fixed at construction",
        "device": "fixed at construction",
        "options": "frozen, fixed at construction",
        "enable_prefix_caching": "options are frozen, fixed at construction",
        "share_pools": "options are frozen, fixed at construction",
        "prefix_retention": "options are frozen, fixed at construction",
        "prefix_retention_interval": "options are frozen, fixed at construction",
        "groups": "fixed at construction",
        "bytes_per_block": "layout arithmetic, fixed",
        "kv_bytes_per_token": "layout arithmetic, fixed",
        "storage_name": "names are fixed at construction",
        "storage_names": "names are fixed at construction",
        "index_of": "layout lookup, fixed",
        "plan_memory": "pure arithmetic on the layout, allocates nothing",
        "swap_out": "only calls swap_out_many, which holds the lock",
        "swap_in": "only calls swap_in_many, which holds the lock",
    },
}


@pytest.mark.parametrize("cls", [BlockManager, CacheController])
def test_every_public_method_holds_the_lock_or_says_why_not(cls):
    unlocked = []
    for name, attr in vars(cls).items():
        if name.startswith("_"):
            continue
        fn = attr.fget if isinstance(attr, property) else attr
        if not (inspect.isfunction(fn) or callable(fn)):
            continue
        if not getattr(fn, "__locked__", False) and name not in LOCK_FREE[cls]:
            unlocked.append(name)
    assert unlocked == []
    # the lock-free list names only what exists
    assert set(LOCK_FREE[cls]) <= set(vars(cls))
