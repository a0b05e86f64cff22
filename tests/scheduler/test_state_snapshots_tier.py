"""Per-request state snapshots in the host tier (``snapshot_policy``): under ``"aligned"`` a
linear-attention snapshot the device evicted is kept in a host page with the full-attention
blocks, and a later prompt hits at the aligned boundary through the host, its restored state
and every other entry equal to the first request's byte for byte; under ``"skip"`` the same
prompt recomputes (the hit is what it was without a host tier); the exact check holds for a
snapshot brought back; the backends' declared policy is followed; bad policies change nothing.

The model is Qwen3-Next-like: two linear-attention layers (group ``linear_state``, one state
slot per request) and two full-attention layers (group ``kv``, block 16), so the boundary is
16 tokens and snapshots are taken every 512 (the default interval: 16 * ceil(512 / 16)).
"""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch

from kvforge import CacheController, GQABackend
from kvforge._checks import ArgumentError
from kvforge.attn_backends.linear_attention import LinearAttentionBackend
from kvforge.core.layout import CacheLayout
from kvforge.core.values import PrefixQuery
from kvforge.scheduler import BlockManager, host_tier
from kvforge.scheduler.host_tier import HostTier, check_snapshot_policy, declared_snapshot_policy
from kvforge.scheduler.unit_records import UnitRecordStore
from kvforge.verify import (
    entry_bytes_for,
    read_entries,
    token_seeds,
    verify_request,
    write_entries,
    write_step,
)

INTERVAL = 512  # the default snapshot interval at a 16-token boundary


def hybrid(
    snapshot_policy: str | None = None, linear_blocks: int = 3, tier: bool = True
) -> CacheController:
    """``linear_blocks`` 3: two usable state blocks, so two requests at once evict a cached
    snapshot; 8: they take free ones and the snapshot stays on the device."""
    linear = LinearAttentionBackend(2, 2, 8, 8, 4)
    kv = GQABackend(1, 8, 16)
    ctl = CacheController({0: linear, 1: kv, 2: linear, 3: kv}, enable_prefix_caching=True)
    ctl.initialize_kv_cache(
        num_blocks={"linear_state": linear_blocks, "kv": 48}, max_num_seqs=2, max_model_len=768
    )
    if tier:
        ctl.initialize_host_tier(num_pages=128, snapshot_policy=snapshot_policy)
    return ctl


def state_entries(ctl: CacheController) -> list:
    return [e for e in ctl.layout.buffers if e.group.name == "linear_state"]


def write_state(ctl: CacheController, rid: str, seeds: torch.Tensor, n: int) -> None:
    """The state after ``n`` tokens is a function of the prefix: bytes of position n - 1."""
    slot = torch.tensor(ctl.block_table(rid, "linear_state"))
    for e in state_entries(ctl):
        data = entry_bytes_for(seeds, e, torch.tensor([n - 1]), e.role.entry_bytes)
        write_entries(ctl.get(e.role.name, e.layer), e, slot, data)


def read_state(ctl: CacheController, rid: str) -> list[torch.Tensor]:
    slot = torch.tensor(ctl.block_table(rid, "linear_state"))
    return [read_entries(ctl.get(e.role.name, e.layer), e, slot) for e in state_entries(ctl)]


def run(
    ctl: CacheController, prompts: dict[str, np.ndarray], snapshots: dict | None = None
) -> None:
    """Prefill ``prompts`` together in chunks of 128 (a snapshot boundary may cut a step),
    writing every token's bytes and each request's state after each step; the state at the
    snapshot boundary goes into ``snapshots``."""
    seeds = {r: token_seeds(t) for r, t in prompts.items()}
    done = dict.fromkeys(prompts, 0)
    while any(done[r] < len(t) for r, t in prompts.items()):
        rids = [r for r in prompts if done[r] < len(prompts[r])]
        sizes = [min(128, len(prompts[r]) - done[r]) for r in rids]
        toks = [prompts[r][done[r] : done[r] + n] for r, n in zip(rids, sizes, strict=True)]
        step = ctl.schedule(rids, sizes, new_token_ids=toks)
        assert not step.allocation.refused, step.allocation.refused
        write_step(ctl, step, seeds)
        for r, n in zip(rids, step.allocation.num_new.tolist(), strict=True):
            done[r] += n
            write_state(ctl, r, seeds[r], done[r])
            if snapshots is not None and done[r] == INTERVAL:
                snapshots[r] = read_state(ctl, r)
        ctl.end_step(step)  # the snapshot copy runs after the step's kernels


def evict_a(ctl: CacheController) -> tuple[np.ndarray, list[torch.Tensor], bytes]:
    """Request A (600 tokens) runs past the boundary at 512 and finishes; two others at once
    evict most of its ``kv`` blocks and, with 3 state blocks, its snapshot. Returns A's
    tokens, its state at 512 and the snapshot's key."""
    a = np.random.default_rng(0).integers(1, 30_000, 600)
    snapshots: dict = {}
    run(ctl, {"a": a}, snapshots)
    ctl.free_request("a")
    [(key, end, _)] = ctl.scheduler.registered_blocks("linear_state").values()
    assert end == INTERVAL
    rng = np.random.default_rng(1)
    run(ctl, {"x": rng.integers(40_000, 50_000, 320), "y": rng.integers(40_000, 50_000, 320)})
    ctl.free_request("x")
    ctl.free_request("y")
    return a, snapshots["a"], key


def prompt_b(a: np.ndarray) -> np.ndarray:
    return np.concatenate([a, np.random.default_rng(2).integers(1, 30_000, 100)])


# ------------------------------------------------------------------ a hit through the host


def test_an_evicted_snapshot_comes_back_from_the_host_byte_for_byte():
    ctl = hybrid("aligned")
    try:
        tier = ctl.host_tier
        assert tier.snapshot_policy == "aligned" and "linear_state" in tier.groups
        a, at_512, key = evict_a(ctl)
        # the snapshot left the device for a host page, its unit record with it
        assert ctl.scheduler.cached_block("linear_state", key) is None
        assert tier.entry("linear_state", key) == (INTERVAL, key, None)
        assert tier.stats.demotions["linear_state"] == 1 and not tier.stats.skipped
        b = prompt_b(a)
        [match] = ctl.lookup([PrefixQuery(b)])
        # the last aligned boundary below B's 700 tokens, snapshot included, through the host
        assert match.num_tokens == INTERVAL == tier.stats.hit_tokens
        assert tier.stats.hits["linear_state"] == 1 and tier.stats.hits["kv"] > 0
        step = ctl.schedule(["b"], [64], new_token_ids=[b[512:576]], prefix_matches=[match])
        assert [c.group for c in step.allocation.onloads] == ["linear_state", "kv"]
        assert [c.group for c in step.allocation.copies_before] == ["linear_state"]
        got = read_state(ctl, "b")  # onloaded, then restored into B's slot before the kernels
        assert len(got) == 4  # conv and recurrent state of both linear layers
        assert all(torch.equal(x, y) for x, y in zip(got, at_512, strict=True))
        write_step(ctl, step, {"b": token_seeds(b)})
        # B's kv entries of [0, 512) are A's (token-derived seeds: one prefix, one content)
        check = verify_request(ctl, "b", token_seeds(b), skip_groups=("linear_state",))
        assert check.entries > 0 and check.mismatched == 0
        ctl.end_step(step)
        assert not tier.pending_blocks
    finally:
        ctl.free()


CASES = [
    # (snapshot_policy, state blocks, B's hit): the snapshot evicted (3 blocks) or on the device
    pytest.param("aligned", 3, INTERVAL, id="aligned-snapshot-on-host"),
    pytest.param("skip", 3, 0, id="skip-snapshot-lost-recomputed"),
    pytest.param("skip", 8, INTERVAL, id="skip-snapshot-on-device"),
    pytest.param("aligned", 8, INTERVAL, id="aligned-snapshot-on-device"),
]


@pytest.mark.parametrize(("policy", "linear_blocks", "hit"), CASES)
def test_skip_recomputes_what_aligned_brings_back(policy, linear_blocks, hit):
    results = {}
    for tiered in (False, True):
        ctl = hybrid(policy, linear_blocks, tier=tiered)
        try:
            a, _, key = evict_a(ctl)
            evicted = ctl.scheduler.cached_block("linear_state", key) is None
            assert evicted == (linear_blocks == 3)
            if tiered:
                tier = ctl.host_tier
                kept = policy == "aligned"
                assert ("linear_state" in tier.groups) == kept
                if kept:  # an evicted snapshot went to a host page, a cached one did not
                    assert (tier.page_of("linear_state", key) is not None) == evicted
            [match] = ctl.lookup([PrefixQuery(prompt_b(a))])
            results[tiered] = match.num_tokens
        finally:
            ctl.free()
    assert results[True] == hit
    if policy == "skip" and linear_blocks == 3:
        assert results[False] == 0  # without the snapshot nothing at 512 can be reused


def test_write_through_keeps_the_snapshot_while_the_device_serves_it():
    ctl = CacheController(
        {0: LinearAttentionBackend(2, 2, 8, 8, 4), 1: GQABackend(1, 8, 16)},
        enable_prefix_caching=True,
    )
    try:
        ctl.initialize_kv_cache(num_blocks={"linear_state": 8, "kv": 48}, max_num_seqs=2)
        ctl.initialize_host_tier(num_pages=64, policy="write_through")
        run(ctl, {"a": np.arange(1, 601)})
        [(key, _, _)] = ctl.scheduler.registered_blocks("linear_state").values()
        tier = ctl.host_tier
        assert tier.page_of("linear_state", key) is not None  # demoted when registered
        assert ctl.scheduler.cached_block("linear_state", key) is not None  # and still served
    finally:
        ctl.free()


# ------------------------------------------------------------------ the exact check


def ignores_tokens(data: bytes) -> bytes:
    """A weak key function: parent key, offset and unit size only (the first 44 bytes of a
    unit preimage), so two prompts of one length get equal keys at every unit."""
    return hashlib.sha256(data[:44]).digest()


def test_a_snapshot_brought_back_is_confirmed_exactly():
    layout = CacheLayout({0: LinearAttentionBackend(2, 2, 8, 8, 4), 1: GQABackend(1, 8, 16)})
    m = BlockManager(
        layout,
        {"linear_state": 3, "kv": 16},
        2,
        256,
        True,
        snapshot_interval=64,
        key_algorithm=ignores_tokens,
    )
    tier = host_tier.attach(m, {"kv": 32, "linear_state": 8}, snapshot_policy="aligned")

    def serve(prompts: dict[str, np.ndarray]) -> None:
        done = dict.fromkeys(prompts, 0)
        while any(done[r] < len(t) for r, t in prompts.items()):
            rids = [r for r in prompts if done[r] < len(prompts[r])]
            toks = [prompts[r][done[r] :] for r in rids]
            step = m.schedule(rids, [len(t) for t in toks], new_token_ids=toks)
            for r, n in zip(rids, step.num_new.tolist(), strict=True):
                done[r] += n
            m.end_step(step)
        m.finish(list(prompts))

    a = np.arange(1, 101)
    serve({"a": a})  # one snapshot, at 64
    [(key, end, _)] = m.registered_blocks("linear_state").values()
    assert end == 64
    serve({"x": np.arange(1000, 1112), "y": np.arange(2000, 2112)})  # evict it and A's kv
    assert m.cached_block("linear_state", key) is None
    assert tier.entry("linear_state", key) == (64, key, None)
    other = np.arange(5001, 5101)  # other tokens, the same keys under the weak key function
    assert m.lookup([PrefixQuery(other)])[0].num_tokens == 0  # the records tell them apart
    assert m.prefix_stats.collisions == 1
    assert tier.stats.hits["linear_state"] == 1  # brought back under A's keys, never served
    assert m.lookup([PrefixQuery(a)])[0].num_tokens == 64  # A's own tokens still hit


# ------------------------------------------------------------------ the declared policy


class SkippingState(LinearAttentionBackend):
    """A linear-attention variant that declares its snapshots recomputed."""

    snapshot_policy = "skip"


class UnknownState(LinearAttentionBackend):
    snapshot_policy = "lazy"  # type: ignore[assignment]


def test_backends_declare_the_policy_and_the_controller_follows_it():
    assert LinearAttentionBackend.snapshot_policy == "aligned"
    assert GQABackend.snapshot_policy == "skip"
    linear = LinearAttentionBackend(2, 2, 8, 8, 4)
    assert declared_snapshot_policy([linear, GQABackend(1, 8, 16)]) == "aligned"
    assert declared_snapshot_policy([GQABackend(1, 8, 16)]) == "skip"  # no per-request group
    assert declared_snapshot_policy([SkippingState(2, 2, 8, 8, 4)]) == "skip"
    ctl = hybrid()  # follows LinearAttentionBackend's "aligned"
    try:
        assert ctl.host_tier.snapshot_policy == "aligned"
        assert ctl.host_tier.per_request == {"linear_state"}
    finally:
        ctl.free()
    ctl = hybrid("skip")  # an explicit policy overrides the declaration
    try:
        assert (
            ctl.host_tier.snapshot_policy == "skip" and "linear_state" not in ctl.host_tier.groups
        )
    finally:
        ctl.free()


BAD_DECLARATIONS = [
    (
        [LinearAttentionBackend(2, 2, 8, 8, 4), SkippingState(2, 2, 8, 8, 4)],
        "declare different snapshot policies",
    ),
    ([UnknownState(2, 2, 8, 8, 4)], "declares snapshot_policy='lazy'"),
]


@pytest.mark.parametrize(("backends", "message"), BAD_DECLARATIONS)
def test_bad_declarations_are_refused(backends, message):
    with pytest.raises(ValueError, match=message):
        declared_snapshot_policy(backends)


def test_backends_that_disagree_need_an_explicit_policy():
    ctl = CacheController(
        {0: LinearAttentionBackend(2, 2, 8, 8, 4), 1: SkippingState(2, 2, 8, 8, 4)},
        enable_prefix_caching=True,
    )
    try:
        ctl.initialize_kv_cache(num_blocks=8, max_num_seqs=2, max_model_len=64)
        with pytest.raises(ValueError, match="pass snapshot_policy explicitly"):
            ctl.initialize_host_tier(num_pages=8)
        assert ctl.host_tier is None
        assert ctl.initialize_host_tier(num_pages=8, snapshot_policy="aligned") == {
            "linear_state": 8
        }
    finally:
        ctl.free()


# ------------------------------------------------------------------ bad policies

BAD_POLICIES = [
    ("store", ArgumentError, "snapshot_policy must be 'skip' or 'aligned', got 'store'"),
    ("ALIGNED", ArgumentError, "snapshot_policy must be 'skip' or 'aligned', got 'ALIGNED'"),
    ("", ArgumentError, "snapshot_policy must be 'skip' or 'aligned', got ''"),
    (1, ArgumentError, "snapshot_policy must be 'skip' or 'aligned', got 1"),
    (
        ("aligned",),
        ArgumentError,
        r"snapshot_policy must be 'skip' or 'aligned', got \('aligned',\)",
    ),
]


@pytest.mark.parametrize(("policy", "error", "message"), BAD_POLICIES)
def test_a_bad_snapshot_policy_is_refused_by_the_tier(policy, error, message):
    with pytest.raises(error, match=message):
        check_snapshot_policy(policy)
    with pytest.raises(error, match=message):
        HostTier({"kv": 4, "state": 4}, UnitRecordStore(), {"state"}, snapshot_policy=policy)


@pytest.mark.parametrize(("policy", "error", "message"), BAD_POLICIES)
def test_a_bad_snapshot_policy_changes_no_manager(policy, error, message):
    layout = CacheLayout({0: LinearAttentionBackend(2, 2, 8, 8, 4), 1: GQABackend(1, 8, 16)})
    m = BlockManager(layout, {"linear_state": 4, "kv": 8}, 2, 64, True)
    hooks = {g: m.pool(g).on_evict for g in m.groups}
    with pytest.raises(error, match=message):
        host_tier.attach(m, {"kv": 4, "linear_state": 4}, snapshot_policy=policy)
    assert m.host_tier is None
    assert {g: m.pool(g).on_evict for g in m.groups} == hooks
    assert not any(m.pool(g).has_eviction_listeners for g in m.groups)
    assert m._prefix.on_store is None


@pytest.mark.parametrize(("policy", "error", "message"), BAD_POLICIES)
def test_a_bad_snapshot_policy_changes_no_controller(policy, error, message):
    ctl = hybrid(tier=False)
    try:
        with pytest.raises(error, match=message):
            ctl.initialize_host_tier(num_pages=16, snapshot_policy=policy)
        assert ctl.host_tier is None
        assert ctl.storage.tier_pages is None
        # refused before anything was made: the tier can still be created
        assert ctl.initialize_host_tier(num_pages=16, snapshot_policy="aligned") == {
            "linear_state": 16,
            "kv": 16,
        }
    finally:
        ctl.free()


def test_skip_keeps_no_snapshot_even_with_pages():
    # a tier given pages for a per-request group under "skip" refuses its snapshots and lets
    # their records go, as before "aligned" existed
    store = UnitRecordStore()
    t = HostTier({"kv": 4, "state": 4}, store, {"state"}, snapshot_policy="skip")
    assert t.recomputed == {"state"}
    key = b"k" * 32
    assert t.demote("state", key, 512, 2) is None and t.stats.skipped == {"state": 1}
    assert t.reserve("state", key, 512, None, None) is None
    aligned = HostTier(
        {"kv": 4, "state": 4}, UnitRecordStore(), {"state"}, snapshot_policy="aligned"
    )
    assert aligned.recomputed == frozenset()
    assert aligned.demote("state", key, 512, 2) == 1
    assert [c.group for c in aligned.take_offloads()] == ["state"]
    assert aligned.reach([{"kv": [], "state": [key]}]) == 1


def test_a_backend_declaring_the_old_setting_name_is_told_the_new_one():
    """``state_policy`` was renamed ``snapshot_policy`` ("state" names only the group kind):
    a backend that still declares the old name is refused by name, never silently read as
    ``"skip"``."""

    class Old(LinearAttentionBackend):
        state_policy = "aligned"

    with pytest.raises(ValueError, match="declares state_policy, which is now snapshot_policy"):
        declared_snapshot_policy([Old(2, 2, 8, 8, 4)])
    assert declared_snapshot_policy([LinearAttentionBackend(2, 2, 8, 8, 4)]) == "aligned"
