"""One value for a step's effects and one place that runs them (issue 33, item 2), and the tier
pages the worker owns (item 3).

- ``StepAllocation.effects`` is the :class:`StepEffects` the worker runs: the step's own
  fields, one object however often it is read, made anew for a replaced step;
- ``CacheStorage.run`` refuses what is not a next step (a table: call, exception type, message
  fragment), changes nothing then, and runs ``copies_before`` last unless told not to;
- ``CacheStorage.pending`` / ``catch_up``: a step handed to the worker and kept from running
  whole (not run at all, or numbered with its copies not run) is finished before anything
  newer, once;
- the storage owns its tier pages: counted by ``host_bytes``, attached once, released once,
  let go of by ``free``;
- ``BlockManager.num_tokens_of``: where a request's next step starts, 0 without a row.
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
from kvforge.core.values import PageCopy, PrefixQuery, StepAllocation, StepEffects
from kvforge.errors import StepOrderError, WorkerRefusedError
from kvforge.scheduler import BlockManager
from kvforge.worker import CacheStorage
from kvforge.worker.tier_pages import HostTierPages

BLOCKS, ROWS, MAX_LEN = 20, 4, 256


def sides() -> tuple[BlockManager, CacheStorage]:
    kv = GQABackend(2, 8, block_size=16)
    layout = CacheLayout({0: kv, 1: kv})
    manager = BlockManager(layout, {"kv": BLOCKS}, ROWS, MAX_LEN, enable_prefix_caching=True)
    storage = CacheStorage(layout)
    storage.create({"kv": BLOCKS}, ROWS, MAX_LEN, share_pools=False)
    return manager, storage


def state(storage: CacheStorage) -> tuple[Any, ...]:
    return (
        storage.next_step,
        storage.next_seq,
        storage.block_table("kv").copy(),
        [c.clone() for c in storage.kv_caches],
    )


def same(a: tuple[Any, ...], b: tuple[Any, ...]) -> bool:
    return (
        a[:2] == b[:2]
        and np.array_equal(a[2], b[2])
        and all(torch.equal(x, y) for x, y in zip(a[3], b[3], strict=True))
    )


def test_effects_are_the_steps_own_fields_one_object_made_anew_on_replace():
    manager, _ = sides()
    step = manager.schedule(["a"], [40])
    effects = step.effects
    assert type(effects) is StepEffects and step.effects is effects
    for name in ("step_id", "request_ids", "table_deltas", "copies_before", "copies_after"):
        assert getattr(effects, name) is getattr(step, name), name
    assert effects.rows is step.rows and effects.num_new is step.num_new
    later = dataclasses.replace(step, step_id=step.step_id + 1)
    assert later.effects.step_id == step.step_id + 1 and later.effects is not effects


def _bad_steps(manager: BlockManager, storage: CacheStorage) -> list[tuple[Callable, type, str]]:
    step = manager.schedule(["a"], [40])
    offload = PageCopy(
        "kv", np.array([1], np.int32), np.array([1], np.int32), owners=np.array([7], np.int64)
    )
    return [
        (lambda: storage.run(step), WorkerRefusedError, "expected a StepEffects"),
        (lambda: storage.run("step"), WorkerRefusedError, "expected a StepEffects"),
        (lambda: storage.apply(object()), WorkerRefusedError, "StepAllocation or StepEffects"),
        (
            lambda: storage.run(dataclasses.replace(step.effects, step_id=step.step_id + 1)),
            StepOrderError,
            "step",
        ),
        (
            lambda: storage.run(dataclasses.replace(step.effects, offloads=(offload,))),
            WorkerRefusedError,
            "no host tier pages",
        ),
    ]


def test_run_refuses_what_is_not_the_next_step_and_changes_nothing():
    manager, storage = sides()
    cases = _bad_steps(manager, storage)
    for call, error, fragment in cases:
        before = state(storage)
        with pytest.raises(error, match=fragment):
            call()
        assert same(before, state(storage))
        assert storage.pending is None


def test_a_refused_pending_step_is_dropped_and_another_pending_step_is_kept():
    manager, storage = sides()
    step = manager.schedule(["a"], [40])
    storage.pending = step
    forged = dataclasses.replace(step.effects, step_id=step.step_id + 5)
    with pytest.raises(StepOrderError):
        storage.run(forged)  # not the pending step: it stays pending
    assert storage.pending is step
    with pytest.raises(StepOrderError):
        storage.run(dataclasses.replace(step, step_id=0).effects)
    assert storage.pending is step
    storage.run(step.effects)
    assert storage.pending is None and storage.next_step == step.step_id + 1


def test_catch_up_runs_a_step_never_run_then_nothing():
    manager, storage = sides()
    assert storage.catch_up() is None
    step = manager.schedule(["a"], [40])
    storage.pending = step  # handed over, then an interrupt before run
    assert storage.catch_up() is step.effects
    assert storage.pending is None and storage.next_step == step.step_id + 1
    assert storage.catch_up() is None  # once
    table = storage.block_table("kv")
    assert (table[manager.row_of("a")][:3] == manager.block_table("a", "kv")[:3]).all()


def test_catch_up_runs_the_copies_on_write_of_a_numbered_step_once(monkeypatch):
    manager, storage = sides()
    tokens = np.arange(40)
    first = manager.schedule(["a"], [40], new_token_ids=[tokens])
    storage.run(first.effects)
    manager.end_step(first)
    [match] = manager.lookup([PrefixQuery(tokens)])
    assert match.num_tokens == 32
    second = manager.schedule(["b"], [40], new_token_ids=[tokens], prefix_matches=[match])
    storage.run(second.effects)
    manager.end_step(second)
    manager.truncate("b", 20)  # into a block shared with "a": copied on write
    step = manager.take_effects()
    assert step is not None and step.copies_before
    real = storage.copy_blocks

    def interrupted(copies: Any) -> None:
        raise KeyboardInterrupt

    storage.pending = step
    monkeypatch.setattr(storage, "copy_blocks", interrupted)
    with pytest.raises(KeyboardInterrupt):
        storage.run(step.effects)  # numbered and mirrored; its copies cut short
    monkeypatch.setattr(storage, "copy_blocks", real)
    assert storage.pending is step and storage.next_step == step.step_id + 1
    assert storage.catch_up() is step.effects and storage.pending is None
    for copy in step.copies_before:
        for e in storage.layout.buffers_of(copy.group):
            raw = storage.kv_caches[e.index]
            assert torch.equal(raw[int(copy.dst[0])], raw[int(copy.src[0])])
    with pytest.raises(WorkerRefusedError, match="already ran"):
        storage.copy_blocks(step.copies_before)  # they ran once


def test_the_storage_owns_its_tier_pages():
    _, storage = sides()
    page = storage.layout.host_page_bytes("kv")
    assert storage.tier_pages is None and storage.host_bytes == 0
    pages = HostTierPages(storage, {"kv": 4})
    assert storage.tier_pages is pages and storage.host_bytes == 4 * page
    for call, fragment in (
        (lambda: HostTierPages(storage, {"kv": 4}), "already"),
        (lambda: storage.attach_tier_pages(pages), "already"),
    ):
        with pytest.raises(RuntimeError, match=fragment):
            call()
        assert storage.tier_pages is pages and storage.host_bytes == 4 * page
    assert storage.release_tier_pages() == 4 * page
    assert storage.release_tier_pages() == 0  # once
    assert storage.tier_pages is None and storage.host_bytes == 0
    HostTierPages(storage, {"kv": 3})  # may be made again
    storage.free()
    assert storage.tier_pages is None and storage.host_bytes == 0


def test_num_tokens_of_is_where_the_next_step_starts():
    manager, _ = sides()
    assert manager.num_tokens_of("a") == 0
    manager.schedule(["a"], [40])
    assert manager.num_tokens_of("a") == 40
    manager.finish(["a"])
    assert manager.num_tokens_of("a") == 0


def test_a_step_allocation_pickles_with_its_effects():
    import pickle

    manager, storage = sides()
    step = manager.schedule(["a"], [40])
    again = pickle.loads(pickle.dumps(step))
    assert isinstance(again, StepAllocation) and again.effects.step_id == step.step_id
    storage.run(again.effects)
    assert storage.next_step == step.step_id + 1
