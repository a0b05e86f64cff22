"""Steps that carry only copies cannot be replayed, reordered or forged into another request's
KV (issue 32, class 1).

A controller with a host tier (both policies) runs random prompts that share prefixes, so its
steps carry every kind of copy: offloads (device blocks to tier pages), onloads (pages back to
device blocks), snapshots and copies on write (device to device) and table deltas, or none of
them. Every step and copy batch the worker applied is recorded. Between prompts, attacks drawn
at random replay a recorded step, copy batch or page copy batch, apply steps out of order, or
forge a step numbered as the next one that carries one contradicting copy: an onload into a
live request's block, an offload into a page that holds a cached prompt's key, an onload from
a page under another key, a device copy into a block no step issued, a row that serves another
request. Each is refused with a :class:`~kvforge.errors.WorkerRefusedError` and changes
nothing: every device byte, every tier page, the mirrored tables. At the end a request that
lived through it all still holds its own bytes, and every prompt's cached prefix, served from
the device or the tier, holds exactly what recomputing it writes.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest
import torch
from _helpers import next_step
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvforge import CacheController, GQABackend
from kvforge.core.values import BlockCopy, PageCopy, PrefixQuery, StepEffects
from kvforge.errors import StepOrderError, WorkerRefusedError
from kvforge.verify import token_seeds, verify_request, write_step

ATTACKS = (
    "replay_step",
    "replay_copies",
    "replay_pages",
    "skip_ahead",
    "onload_into_live",
    "offload_into_held",
    "onload_wrong_key",
    "unissued_copy",
    "row_of_another",
)


class Recorder:
    """The steps and copy batches the worker applied, in order."""

    def __init__(self, ctl: CacheController) -> None:
        self.steps: list[StepEffects] = []
        self.copies: list[tuple[BlockCopy, ...]] = []
        storage = ctl.storage
        run, copy_blocks = storage.run, storage.copy_blocks

        def recorded_run(effects: StepEffects, copies_before: bool = True) -> None:
            run(effects, copies_before)  # every step goes through it (apply() too)
            self.steps.append(effects)

        def recorded_copies(copies: Any) -> None:
            copy_blocks(copies)
            if copies:
                self.copies.append(tuple(copies))

        storage.run = recorded_run  # type: ignore[method-assign]
        storage.copy_blocks = recorded_copies  # type: ignore[method-assign]


def controller(policy: str) -> CacheController:
    swa = GQABackend(2, 8, block_size=16, sliding_window=32)
    kv = GQABackend(2, 8, block_size=16)
    ctl = CacheController({0: swa, 1: kv, 2: swa, 3: kv}, enable_prefix_caching=True)
    ctl.initialize_kv_cache(num_blocks=24, max_num_seqs=3, max_model_len=512)
    ctl.initialize_host_tier(num_pages=64, policy=policy)
    return ctl


def state(ctl: CacheController) -> list[torch.Tensor]:
    tier = ctl.storage.tier_pages
    return (
        [c.view(torch.uint8).clone() for c in ctl.kv_caches]
        + [p.pages.clone() for p in tier.groups.values()]
        + [torch.from_numpy(ctl.storage.block_table(g).copy()) for g in ctl.groups]
    )


def run(ctl: CacheController, rid: str, toks: np.ndarray, chunk: int) -> None:
    """Look ``toks`` up, prefill the rest in chunks writing every token's bytes, check the
    whole request (reused blocks included) against a recompute."""
    [match] = ctl.lookup([PrefixQuery(toks)])
    seeds = token_seeds(toks)
    done = match.num_tokens
    first = True
    while done < len(toks):
        n = min(chunk, len(toks) - done)
        step = ctl.schedule(
            [rid],
            [n],
            new_token_ids=[toks[done : done + n]],
            prefix_matches=[match] if first and match.num_tokens else None,
        )
        assert not step.allocation.refused, step.allocation.refused
        write_step(ctl, step, {rid: seeds})
        ctl.end_step(step)
        done, first = done + n, False
    check = verify_request(ctl, rid, seeds)
    assert check.mismatched == 0 and check.entries > 0


def truncatable(num_tokens: int, window: int = 32, block: int = 16) -> int:
    """The fewest tokens a request of ``num_tokens`` may be truncated to: its window group
    released the blocks before ``(num_tokens - window) // block * block``."""
    released = max(num_tokens - window, 0) // block * block
    return max(17, released + window if released else 17)


def live_block(ctl: CacheController, rid: str, group: str) -> int:
    table = np.asarray(ctl.block_table(rid, group))
    return int(table[table != 0][-1])


def free_block(ctl: CacheController, group: str) -> int:
    held: set[int] = set()
    for g in ctl.groups:
        held |= set(ctl.storage.block_table(g).ravel().tolist())
    return next(b for b in range(1, ctl.storage.num_blocks[group]) if b not in held)


def page_copy(
    ctl: CacheController, group: str, block: int, page: int, tag: int, seq_shift: int = 0
) -> PageCopy:
    tier = ctl.storage.tier_pages
    return PageCopy(
        group,
        np.array([block], np.int32),
        np.array([page], np.int32),
        owners=np.array([tag], np.int64),
        seq=tier.ledger.next_seq + seq_shift,
    )


def held_page(ctl: CacheController, group: str) -> tuple[int, int] | None:
    owners = ctl.storage.tier_pages.ledger.owners[group]
    held = np.flatnonzero(owners)
    return (int(held[0]), int(owners[held[0]])) if len(held) else None


def attack(ctl: CacheController, rec: Recorder, kind: str, pick: int) -> bool:
    """Run one attack; ``False`` when the state offers no target for it."""
    storage, tier = ctl.storage, ctl.storage.tier_pages
    if kind == "replay_step":
        if not rec.steps:
            return False
        old = rec.steps[pick % len(rec.steps)]
        call = lambda: storage.apply(old)  # noqa: E731
    elif kind == "replay_copies":
        if not rec.copies:
            return False
        batch = rec.copies[pick % len(rec.copies)]
        call = lambda: storage.copy_blocks(batch)  # noqa: E731
    elif kind == "replay_pages":
        paged = [s for s in rec.steps if s.offloads or s.onloads]
        if not paged:
            return False
        s = paged[pick % len(paged)]
        call = lambda: tier.move(s.offloads, s.onloads)  # noqa: E731
    elif kind == "skip_ahead":  # a later step before the next: a gap
        step = next_step(ctl.storage)
        call = lambda: storage.apply(dataclasses.replace(step, step_id=step.step_id + 1))  # noqa: E731
    elif kind == "onload_into_live":
        held = held_page(ctl, "kv")
        if held is None:
            return False
        page, tag = held
        onload = page_copy(ctl, "kv", live_block(ctl, "victim", "kv"), page, tag)
        call = lambda: storage.apply(next_step(ctl.storage, onloads=(onload,)))  # noqa: E731
    elif kind == "offload_into_held":
        held = held_page(ctl, "kv")
        if held is None:
            return False
        page, tag = held
        offload = page_copy(ctl, "kv", free_block(ctl, "kv"), page, tag + 1)
        call = lambda: storage.apply(next_step(ctl.storage, offloads=(offload,)))  # noqa: E731
    elif kind == "onload_wrong_key":
        held = held_page(ctl, "kv")
        if held is None:
            return False
        page, tag = held
        onload = page_copy(ctl, "kv", free_block(ctl, "kv"), page, tag ^ 0x5A5A)
        call = lambda: storage.apply(next_step(ctl.storage, onloads=(onload,)))  # noqa: E731
    elif kind == "unissued_copy":  # into a block only the prefix cache (or nobody) holds
        src = np.array([live_block(ctl, "victim", "kv")], np.int32)
        dst = np.array([free_block(ctl, "kv")], np.int32)
        call = lambda: storage.copy_blocks([BlockCopy("kv", src, dst, -1)])  # noqa: E731
    else:  # row_of_another: the intruder's tokens at the victim's row
        row = ctl.scheduler.row_of("victim")
        step = next_step(
            ctl.storage,
            request_ids=("intruder",),
            rows=np.array([row], np.int32),
            num_computed=np.array([0], np.int64),
            num_new=np.array([16], np.int64),
        )
        call = lambda: storage.apply(step)  # noqa: E731
    before = state(ctl)
    with pytest.raises(WorkerRefusedError):
        call()
    after = state(ctl)
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True)), kind
    return True


@pytest.mark.parametrize("policy", ["eviction", "write_through"])
@settings(
    max_examples=6,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(data=st.data())
@pytest.mark.slow
def test_copies_are_applied_once_in_order_and_only_as_owned(policy: str, data: Any) -> None:
    ctl = controller(policy)
    rec = Recorder(ctl)
    victim = np.arange(900, 948)
    run(ctl, "victim", victim, chunk=48)
    heads = [np.arange(1000 * h, 1000 * h + 96) for h in range(3)]
    prompts: list[np.ndarray] = []
    refused = 0
    for i in range(data.draw(st.integers(6, 12), label="prompts")):
        head = heads[data.draw(st.integers(0, 2), label="head")]
        keep = data.draw(st.integers(17, 96), label="shared")
        tail = np.arange(20_000 + 100 * i, 20_000 + 100 * i + data.draw(st.integers(1, 80)))
        toks = np.concatenate([head[:keep], tail])
        run(ctl, f"r{i}", toks, chunk=data.draw(st.sampled_from([16, 32, 64]), label="chunk"))
        lo, hi = truncatable(len(toks)), len(toks) // 16 * 16 - 1
        if lo <= hi and data.draw(st.booleans(), label="truncate"):
            run(ctl, f"twin{i}", toks, chunk=64)  # shares r{i}'s blocks: a copy on write
            ctl.truncate(f"twin{i}", data.draw(st.integers(lo, hi), label="to"))
            ctl.free_request(f"twin{i}")
        ctl.free_request(f"r{i}")
        prompts.append(toks)
        for _ in range(data.draw(st.integers(0, 3), label="attacks")):
            kind = data.draw(st.sampled_from(ATTACKS), label="attack")
            refused += attack(ctl, rec, kind, data.draw(st.integers(0, 1 << 16)))
    assert verify_request(ctl, "victim", token_seeds(victim)).mismatched == 0
    for i, toks in enumerate(prompts):  # every cached prefix still holds its own bytes
        run(ctl, f"again{i}", toks, chunk=64)
        ctl.free_request(f"again{i}")
    ctl.free()


def test_every_attack_has_a_target_in_a_short_run() -> None:
    """The attacks are not vacuous: after a few prompts each one finds what it aims at."""
    ctl = controller("write_through")
    rec = Recorder(ctl)
    victim = np.arange(900, 941)
    run(ctl, "victim", victim[:40], chunk=40)
    for i in range(6):
        toks = np.concatenate([np.arange(1000, 1096), np.arange(5000 + 100 * i, 5040 + 100 * i)])
        run(ctl, f"r{i}", toks, chunk=32)
        ctl.free_request(f"r{i}")
    for i in range(3):  # unrelated prompts push the head out of the device: it comes back
        run(ctl, f"flush{i}", np.arange(30_000 + 1000 * i, 30_176 + 1000 * i), chunk=32)
        ctl.free_request(f"flush{i}")
    run(ctl, "back", np.concatenate([np.arange(1000, 1096), np.arange(9000, 9010)]), chunk=32)
    ctl.free_request("back")
    short = np.arange(7000, 7040)
    run(ctl, "holder", short, chunk=40)
    run(ctl, "twin", short, chunk=40)  # shares the holder's two complete blocks
    ctl.truncate("twin", 20)  # into a shared block: a copy on write
    ctl.free_requests(["twin", "holder"])
    assert [k for k in ATTACKS if not attack(ctl, rec, k, 3)] == []
    assert any(s.onloads for s in rec.steps) and rec.copies  # every kind of copy ran
    # write_through: steps that carry offloads and no table delta (effects between steps);
    # a retry of one after its blocks were reused would rewrite a cached prompt's pages
    only_copies = [s for s in rec.steps if s.offloads and not s.table_deltas]
    assert only_copies
    for step in only_copies:
        before = state(ctl)
        with pytest.raises(StepOrderError, match="a repeat or a reordering"):
            ctl.storage.apply(step)
        assert all(torch.equal(a, b) for a, b in zip(before, state(ctl), strict=True))
    assert verify_request(ctl, "victim", token_seeds(victim[:40])).mismatched == 0
    ctl.free()
