"""Bad input to the scheduler side, the facade and the worker side: a clear error, no change.

Every row is (call, exception type, message fragment). The fixture builds one controller with
a full group ``kv`` (B=16) and a sliding-window group ``gqa_swa`` (B=16, W=32), request ``a``
grown to 100 tokens in steps of 20, ``b`` at 40 tokens, and ``s`` swapped out. After each
failing call the test compares a snapshot of the whole state: pool counts, both sides' tables,
token counts, resident and swapped sets, host page usage and a hash of every cache byte.

Why ``truncate("a", 48)`` is refused: the last step of ``a`` started at token 80, which reads
from ``80 + 1 - 32 = 49``, so blocks 0..2 (tokens 0..47) of ``gqa_swa`` went back; 48 tokens
span ``cdiv(48, 16) = 3`` blocks, the first of which is gone.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch

from kvforge import CacheController, GQABackend
from kvforge.core.values import SwapResult
from kvforge.errors import RequestStateError
from kvforge.verify import write_request
from kvforge.worker import CacheStorage

NUM_BLOCKS = {"kv": 24, "gqa_swa": 24}


@dataclass
class Env:
    ctl: CacheController

    @property
    def manager(self) -> Any:
        return self.ctl.scheduler


def _make() -> Env:
    ctl = CacheController(
        {
            0: GQABackend(1, 8, block_size=16),
            1: GQABackend(1, 8, block_size=16, sliding_window=32, group="gqa_swa"),
        }
    )
    ctl.initialize_kv_cache(num_blocks=NUM_BLOCKS, max_num_seqs=4, max_model_len=256)
    ctl.initialize_host_cache(num_pages=16)
    for _ in range(5):
        ctl.end_step(ctl.schedule(["a"], [20]))
    ctl.end_step(ctl.schedule(["b", "s"], [40, 30]))
    for seed, rid in enumerate(("a", "b", "s")):
        write_request(ctl, rid, seed, range(ctl.num_tokens(rid)))
    ctl.swap_out("s")
    return Env(ctl)


def snapshot(env: Env) -> dict[str, Any]:
    ctl, manager = env.ctl, env.manager
    digest = hashlib.sha256()
    for t in ctl.kv_caches:
        digest.update(t.contiguous().view(torch.uint8).numpy().tobytes())
    return {
        "pools": {g: (ctl.num_used_blocks(g), ctl.num_free_blocks(g)) for g in ctl.groups},
        "tables": {g: manager.table(g).tobytes() for g in ctl.groups},
        "mirror": {g: ctl.storage.block_table(g).tobytes() for g in ctl.groups},
        "requests": manager.requests,
        "swapped": manager.swapped_requests,
        "tokens": {r: manager.num_tokens(r) for r in manager.requests + manager.swapped_requests},
        "host": ctl.host_pool_usage(),
        "rows": manager.num_free_rows,
        "bytes": digest.hexdigest(),
    }


def test_fixture_state_by_hand() -> None:
    env = _make()
    s = snapshot(env)
    assert s["requests"] == ["a", "b"] and s["swapped"] == ["s"]
    assert s["tokens"] == {"a": 100, "b": 40, "s": 30}
    # kv: a 7 blocks (cdiv(100, 16)), b 3; swa: a holds blocks 3..6 (released 0..2), b 3;
    # kv and gqa_swa pair up byte for byte, so they draw on one pool (share_pools, the
    # default): 17 of its 23 usable blocks are used
    assert s["pools"] == {"kv": (17, 6), "gqa_swa": (17, 6)}
    assert env.ctl.block_table("a", "gqa_swa")[:3] == [0, 0, 0]


CALLS: list[tuple[str, Callable[[Env], Any], type[BaseException], str]] = [
    # BlockManager.schedule
    ("schedule_int_ids", lambda e: e.manager.schedule(5, [1]), TypeError, "got int"),
    ("schedule_str_ids", lambda e: e.manager.schedule("a", [1]), TypeError, "got str"),
    ("schedule_dup", lambda e: e.manager.schedule(["a", "a"], [1, 1]), ValueError, "'a' twice"),
    (
        "schedule_empty_id",
        lambda e: e.manager.schedule(["new", ""], [1, 1]),
        RequestStateError,
        "request_id must be a non-empty str, got ''",
    ),
    (
        "schedule_len",
        lambda e: e.manager.schedule(["a"], [1, 2]),
        ValueError,
        "num_new_tokens has shape (2,), expected (1,)",
    ),
    (
        "schedule_negative",
        lambda e: e.manager.schedule(["new", "a"], [1, -1]),
        ValueError,
        "num_new_tokens must be >= 0, got -1",
    ),
    (
        "schedule_float",
        lambda e: e.manager.schedule(["a"], [1.5]),
        ValueError,
        "num_new_tokens must hold ints, got 1.5",
    ),
    (
        "schedule_float_array",
        lambda e: e.manager.schedule(["a"], np.array([1.0])),
        ValueError,
        "num_new_tokens must be integers, got dtype float64",
    ),
    (
        "schedule_bool",
        lambda e: e.manager.schedule(["a"], [True]),
        ValueError,
        "num_new_tokens must hold ints, got True",
    ),
    (
        "schedule_swapped",
        lambda e: e.manager.schedule(["new", "s"], [1, 1]),
        RequestStateError,
        "request 's' is swapped out; swap it in before scheduling it",
    ),
    (
        "facade_schedule_swapped",
        lambda e: e.ctl.schedule(["a", "s"], [1, 1]),
        RequestStateError,
        "request 's' is swapped out",
    ),
    # finish
    ("finish_unknown", lambda e: e.manager.finish(["a", "zzz"]), RequestStateError, "'zzz'"),
    ("finish_str", lambda e: e.manager.finish("a"), TypeError, "got str"),
    ("finish_dup", lambda e: e.manager.finish(["b", "b"]), ValueError, "'b' twice"),
    ("free_request_empty", lambda e: e.ctl.free_request(""), RequestStateError, "non-empty"),
    # truncate
    (
        "truncate_released",
        lambda e: e.manager.truncate("a", 48),
        ValueError,
        "group 'gqa_swa' already released the blocks before token 48",
    ),
    (
        "truncate_above",
        lambda e: e.manager.truncate("a", 101),
        ValueError,
        "num_tokens must be an int in [1, 100] for request 'a', got 101",
    ),
    ("truncate_zero", lambda e: e.manager.truncate("a", 0), ValueError, "got 0"),
    ("truncate_bool", lambda e: e.manager.truncate("a", True), ValueError, "got True"),
    ("truncate_float", lambda e: e.manager.truncate("a", 90.0), ValueError, "got 90.0"),
    ("truncate_unknown", lambda e: e.ctl.truncate("zzz", 5), RequestStateError, "'zzz'"),
    ("truncate_swapped", lambda e: e.ctl.truncate("s", 5), RequestStateError, "swapped out"),
    # plan_swap_out / swap entry points
    (
        "swap_out_purpose",
        lambda e: e.manager.plan_swap_out(["a"], "bogus"),
        ValueError,
        "purpose must be one of",
    ),
    ("swap_out_unknown", lambda e: e.ctl.swap_out_many(["a", "zzz"]), RequestStateError, "zzz"),
    ("swap_out_swapped", lambda e: e.ctl.swap_out("s"), RequestStateError, "already swapped"),
    ("swap_out_dup", lambda e: e.ctl.swap_out_many(["a", "a"]), ValueError, "'a' twice"),
    ("swap_in_resident", lambda e: e.ctl.swap_in("a"), RequestStateError, "not swapped out"),
    # complete_swap
    (
        "complete_unknown_plan",
        lambda e: e.manager.complete_swap(SwapResult(999)),
        ValueError,
        "swap plan 999 is not in flight",
    ),
    (
        "complete_not_result",
        lambda e: e.manager.complete_swap("done"),
        TypeError,
        "result must be a SwapResult, got str",
    ),
    # CacheController.slot_mapping / index_of
    (
        "slots_float",
        lambda e: e.ctl.slot_mapping("a", "kv", [1.5, 2.7]),
        ValueError,
        "positions must be ints, got 1.5",
    ),
    (
        "slots_bool",
        lambda e: e.ctl.slot_mapping("a", "kv", [True, False]),
        ValueError,
        "positions must be ints, got True",
    ),
    (
        "slots_float_tensor",
        lambda e: e.ctl.slot_mapping("a", "kv", torch.tensor([1.5])),
        ValueError,
        "positions must be integers, got dtype float32",
    ),
    (
        "slots_out_of_range",
        lambda e: e.ctl.slot_mapping("a", "kv", [100]),
        ValueError,
        "position 100 is outside request 'a', which holds tokens 0..99",
    ),
    (
        "slots_ratio",
        lambda e: e.ctl.slot_mapping("a", "kv", [1], compress_ratio=3),
        ValueError,
        "compress_ratio=3 does not divide block_size=16",
    ),
    ("slots_swapped", lambda e: e.ctl.slot_mapping("s", "kv", [1]), RequestStateError, "'s'"),
    ("index_of_bool", lambda e: e.ctl.index_of("key", True), KeyError, "got True"),
    # shared pools: kv and gqa_swa pages pair up byte for byte, so they form one pool set
    (
        "controller_share_pools_str",
        lambda e: CacheController(e.ctl.layout.backends, share_pools="yes"),
        TypeError,
        "share_pools must be a bool, got 'yes'",
    ),
    (
        "storage_create_share_pools_str",
        lambda e: CacheStorage(e.ctl.layout).create(NUM_BLOCKS, 4, 256, share_pools="yes"),
        TypeError,
        "share_pools must be a bool, got 'yes'",
    ),
    (
        "storage_create_shared_unequal",
        lambda e: CacheStorage(e.ctl.layout).create(
            {"kv": 24, "gqa_swa": 20}, 4, 256, share_pools=True
        ),
        ValueError,
        "num_blocks gives {'kv': 24, 'gqa_swa': 20} to groups ['kv', 'gqa_swa'], which share",
    ),
    (
        "storage_adopt_shared_one_group_alias",
        lambda e: CacheStorage(e.ctl.layout).adopt(
            dict.fromkeys(
                [b.key for b in e.ctl.layout.buffers],
                torch.zeros((24, 16, 1, 8), dtype=torch.bfloat16),
            ),
            4,
            256,
            share_pools=True,
        ),
        ValueError,
        "share bytes (block 0 of the first and block 0 of the second)",
    ),
]


@pytest.mark.parametrize(
    ("call", "exc", "fragment"), [c[1:] for c in CALLS], ids=[c[0] for c in CALLS]
)
def test_bad_call_changes_nothing(
    call: Callable[[Env], Any], exc: type[BaseException], fragment: str
) -> None:
    env = _make()
    before = snapshot(env)
    with pytest.raises(exc) as info:
        call(env)
    assert fragment in str(info.value)
    assert snapshot(env) == before
    # the manager is still usable: a normal step goes through
    step = env.ctl.schedule(["a", "b"], [1, 1])
    assert step.allocation.request_ids == ("a", "b") and not step.allocation.refused


# ---------------------------------------------------------------- CacheStorage.adopt


def _adopt_case(kind: str, env: Env) -> dict[tuple[str, int], torch.Tensor]:
    caches = {
        key: torch.zeros_like(env.ctl.get(*key)) for key in (e.key for e in env.ctl.layout.buffers)
    }
    if kind == "missing":
        del caches[("value", 1)]
    elif kind == "shape":
        t = caches[("key", 0)]
        caches[("key", 0)] = torch.zeros((t.shape[0] + 1, *t.shape[1:]), dtype=t.dtype)
    elif kind == "shared":
        caches[("value", 0)] = caches[("key", 0)]
    return caches


ADOPT = [
    ("missing", ValueError, "missing [('value', 1)]"),
    (
        "shape",
        ValueError,
        "adopt: cache ('value', 0) has 24 blocks but other caches of group 'kv' have 25",
    ),
    ("shared", ValueError, "share bytes"),
]


@pytest.mark.parametrize(("kind", "exc", "fragment"), ADOPT, ids=[a[0] for a in ADOPT])
def test_adopt_refuses_and_stays_empty(kind: str, exc: type[BaseException], fragment: str) -> None:
    env = _make()
    storage = CacheStorage(env.ctl.layout)
    with pytest.raises(exc) as info:
        storage.adopt(_adopt_case(kind, env), max_num_seqs=4, max_model_len=256)
    assert fragment in str(info.value)
    assert not storage.ready
    # a valid set of the same tensors is still adopted afterwards
    blocks = storage.adopt(_adopt_case("valid", env), max_num_seqs=4, max_model_len=256)
    assert blocks == NUM_BLOCKS
    assert storage.ready


def test_adopt_wrong_block_shape() -> None:
    env = _make()
    storage = CacheStorage(env.ctl.layout)
    caches = _adopt_case("valid", env)
    for layer in (0, 1):
        for role in ("key", "value"):
            t = caches[(role, layer)]
            caches[(role, layer)] = torch.zeros((t.shape[0], 16, 2, 4), dtype=t.dtype)
    with pytest.raises(ValueError, match=r"shape \(24, 16, 2, 4\).*expected \(24, 16, 1, 8\)"):
        storage.adopt(caches, max_num_seqs=4, max_model_len=256)
    assert not storage.ready
