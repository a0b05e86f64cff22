"""kvforge's vLLM offloading manager, driven through vLLM's own interface types (``ReqContext``,
``make_offload_key``, ``LookupResult``): the invariants of kvforge/integrations/vllm/manager.py,
plus the page plan and the options."""

from __future__ import annotations

import pytest

vllm = pytest.importorskip(
    "vllm", reason="vLLM is not installed: pip install 'kvforge[vllm]' (docs/integrations/vllm.md)"
)

from vllm.v1.kv_offload.base import (  # noqa: E402
    LookupResult,
    ReqContext,
    make_offload_key,
)

from kvforge._checks import ArgumentError  # noqa: E402
from kvforge.integrations.vllm.checks import TransferRefusedError  # noqa: E402
from kvforge.integrations.vllm.config import (  # noqa: E402
    DEFAULT_HOST_BYTES,
    parse_options,
)
from kvforge.integrations.vllm.manager import KVForgeOffloadingManager  # noqa: E402
from kvforge.integrations.vllm.pages import plan_host_pages  # noqa: E402

HIT, MISS, PENDING = LookupResult.HIT, LookupResult.MISS, LookupResult.HIT_PENDING


def key(i: int, group: int = 0) -> bytes:
    return make_offload_key(i.to_bytes(32, "big"), group)


def ctx(req: str = "A", ends: dict[bytes, int] | None = None) -> ReqContext:
    c = ReqContext(req_id=req)
    for k, end in (ends or {}).items():
        c.set_offload_key_position(k, end)
    return c


def manager(pages: int = 3, groups: tuple[int, ...] = (0, 2), events: bool = True):
    plan = plan_host_pages(list(groups), [100] * len(groups), 1, 100 * len(groups) * pages)
    assert plan.num_pages == pages
    return KVForgeOffloadingManager(plan, enable_events=events)


def store(m: KVForgeOffloadingManager, keys: list[bytes], req: str = "A") -> list[bytes]:
    out = m.prepare_store(keys, ctx(req))
    assert out is not None
    m.complete_store(out.keys_to_store, ctx(req))
    return out.keys_to_store


def states(m: KVForgeOffloadingManager, keys: list[bytes]) -> list[LookupResult]:
    return [m.lookup(k, ctx()) for k in keys]


def test_store_then_load_names_the_same_pages_per_group():
    m = manager()
    ks = [key(1), key(2), key(1, group=2)]
    out = m.prepare_store(ks, ctx())
    assert out.keys_to_store == ks and out.evicted_keys == []
    assert [p.tolist() for p in out.store_spec.pages] == [[1, 2], [1]]  # one space per group
    assert states(m, ks) == [PENDING] * 3
    m.complete_store(ks, ctx())
    assert states(m, ks) == [HIT] * 3
    load = m.prepare_load([key(2), key(1), key(1, group=2)], ctx("B", {key(1): 16, key(2): 32}))
    assert [p.tolist() for p in load.pages] == [[1, 2], [1]]  # prefix order, by end token
    m.complete_load([key(1), key(2), key(1, group=2)], ctx("B"))
    assert m.held() == {0: 2, 2: 1}
    assert [(e.removed, e.keys) for e in m.take_events()] == [(False, ks)]


def test_keys_held_already_are_not_stored_again_and_never_evicted_by_their_own_call():
    m = manager(pages=3)
    store(m, [key(1), key(2), key(3)])
    before = states(m, [key(1), key(2), key(3), key(4), key(5)])
    # two held keys of the call are pinned: one evictable page (key 3) is left for two new keys
    assert m.prepare_store([key(1), key(2), key(4), key(5)], ctx()) is None
    assert states(m, [key(1), key(2), key(3), key(4), key(5)]) == before
    assert m.allocation_failures == 1
    out = m.prepare_store([key(1), key(2), key(4)], ctx())
    assert out.keys_to_store == [key(4)] and out.evicted_keys == [key(3)]
    assert states(m, [key(1), key(2), key(3), key(4)]) == [HIT, HIT, MISS, PENDING]


def test_lru_evicts_the_least_recently_used_and_reports_it():
    m = manager(pages=3)
    store(m, [key(1)])
    store(m, [key(2)])
    store(m, [key(3)])
    list(m.take_events())
    m.touch([key(1)], ctx())
    out = m.prepare_store([key(4)], ctx())
    assert out.evicted_keys == [key(2)]
    assert states(m, [key(1), key(2), key(3)]) == [HIT, MISS, HIT]
    [event] = list(m.take_events())
    assert event.removed and event.keys == [key(2)]


def test_a_page_in_flight_is_never_evicted():
    m = manager(pages=2)
    first = m.prepare_store([key(1)], ctx())  # store in flight
    store(m, [key(2)])
    m.prepare_load([key(2)], ctx("B"))  # load in flight
    assert m.prepare_store([key(3)], ctx()) is None
    m.complete_store(first.keys_to_store, ctx())
    m.complete_load([key(2)], ctx("B"))
    assert m.prepare_store([key(3)], ctx()).evicted_keys == [key(1)]


def test_completions_count_only_for_their_request_once():
    m = manager(pages=2)
    out = m.prepare_store([key(1)], ctx("A"))
    with pytest.raises(TransferRefusedError, match="request 'A' reserved its store"):
        m.complete_store(out.keys_to_store, ctx("B"))  # foreign: refused
    assert states(m, [key(1)]) == [PENDING]
    m.complete_store(out.keys_to_store, ctx("A"))
    with pytest.raises(TransferRefusedError, match="no store of it outstanding"):
        m.complete_store(out.keys_to_store, ctx("A", {}), success=False)  # replayed: refused
    assert states(m, [key(1)]) == [HIT] and m.stores_failed == 0
    store(m, [key(2)])
    m.prepare_load([key(1)], ctx("A"))
    m.prepare_load([key(1)], ctx("B"))
    m.complete_load([key(1)], ctx("A"))
    for _ in range(3):  # A's completion replayed: refused, B's pin still holds
        with pytest.raises(TransferRefusedError, match="request 'A' has no load of it"):
            m.complete_load([key(1)], ctx("A"))
    assert m.prepare_store([key(3)], ctx()).evicted_keys == [key(2)]
    m.complete_load([key(1)], ctx("B"))
    m.complete_store([key(3)], ctx())
    assert m.prepare_store([key(4)], ctx()).evicted_keys == [key(1)]


@pytest.mark.parametrize("how", ["success_false", "worker_reported"])
def test_a_failed_store_is_forgotten_and_counted(how):
    m = manager(pages=2)
    out = m.prepare_store([key(1), key(2)], ctx())
    if how == "success_false":
        m.complete_store(out.keys_to_store, ctx(), success=False)
    else:
        m.mark_failed([key(1)], ctx())
        m.complete_store(out.keys_to_store, ctx())
    lost = [key(1), key(2)] if how == "success_false" else [key(1)]
    assert all(m.lookup(k, ctx()) == MISS for k in lost)
    assert m.stores_failed == len(lost)
    events = list(m.take_events())
    assert events[0].metadata_only and events[0].keys == lost
    assert m.prepare_store([key(3), key(4)], ctx()) is not None  # the pages are free again


def test_reset_forgets_everything_in_flight_or_not():
    m = manager(pages=2)
    store(m, [key(1)])
    m.prepare_load([key(1)], ctx("B"))
    m.prepare_store([key(2)], ctx())
    m.reset_cache()
    assert states(m, [key(1), key(2)]) == [MISS, MISS]
    assert m.held() == {0: 0, 2: 0}
    with pytest.raises(TransferRefusedError):  # a completion from before the reset: refused
        m.complete_load([key(1)], ctx("B"))
    assert m.prepare_store([key(3), key(4)], ctx()).keys_to_store == [key(3), key(4)]


def test_stats_and_config_info():
    m = manager(pages=2)
    m.prepare_store([key(1)], ctx())
    stats = m.get_stats()
    assert stats is not None
    assert m.usage() == (0.25, 0.0)  # one of 4 pages (2 groups x 2) pinned by a store
    [info] = m.config_info()
    assert info["cpu_num_chunks"] == 4 and info["cpu_kv_cache_size_bytes"] == 400


@pytest.mark.parametrize(
    ("call", "exc", "message"),
    [
        (lambda m: m.prepare_store([key(1), key(9, group=7)], ctx()), KeyError, "names no"),
        (lambda m: m.prepare_store([b"x"], ctx()), KeyError, "names no"),
        (lambda m: m.prepare_load([key(1), key(5)], ctx()), KeyError, "not held"),
        (lambda m: m.prepare_load([key(6)], ctx()), KeyError, "still being stored"),
    ],
)
def test_bad_calls_change_nothing(call, exc, message):
    m = manager(pages=3)
    store(m, [key(1)])
    m.prepare_store([key(6)], ctx())
    before = (states(m, [key(1), key(5), key(6)]), m.held(), m.usage())
    with pytest.raises(exc, match=message):
        call(m)
    assert (states(m, [key(1), key(5), key(6)]), m.held(), m.usage()) == before
    assert m.lookup(key(1, group=7), ctx()) == MISS


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (([], [], 1, 10), "non-empty and of one length"),
        (([0, 1], [10], 1, 10), "non-empty and of one length"),
        (([0, 0], [10, 10], 1, 100), "distinct"),
        (([-1], [10], 1, 100), r"group_ids\[\] must be an int >= 0, got -1"),
        (([0], [0], 1, 100), r"block_bytes\[\] must be a positive int, got 0"),
        (([0], [10], True, 100), "blocks_per_chunk must be a positive int, got True"),
        (([0], [10], 1, 0), "host_bytes must be a positive int, got 0"),
        (([0, 1], [60, 50], 2, 219), r"host_bytes=219 holds no chunk: .* takes 220 B"),
    ],
)
def test_plan_refuses_bad_input(args, message):
    with pytest.raises(ArgumentError, match=message):
        plan_host_pages(*args)


def test_plan_counts_unpadded_pages_per_group():
    # DeepSeek-V4-Flash's device pages (B): every group's own page, no padding to the largest
    plan = plan_host_pages([0, 1, 2, 3], [37_440, 8_640, 1_728, 32_832], 1, 80_640 * 10 + 5)
    assert plan.num_pages == 10 and plan.host_bytes == 806_400
    with pytest.raises(ArgumentError, match=r"group 5 is not offloaded; offloaded groups are"):
        plan.position(5)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"kvforge": [1]}, r"\['kvforge'\] must be an object, got \[1\]"),
        ({"kvforge": {"host_byte": 1}}, r"^kvforge option 'host_byte'=1: no such option; "),
        ({"kvforge": {"host_bytes": 0}}, r"^kvforge option 'host_bytes'=0: must be a positive"),
        ({"kvforge": {"host_bytes": "8G"}}, r"^kvforge option 'host_bytes'='8G': must be a"),
        ({"kvforge": {"gather_impl": "cuda"}}, r"^kvforge option 'gather_impl'='cuda': must be"),
        ({"kvforge": {"pin_memory": 1}}, r"^kvforge option 'pin_memory'=1: must be true, false"),
        ({"cpu_bytes_to_use": -5}, r"option 'cpu_bytes_to_use'=-5: must be a positive whole"),
        ({"cpu_bytes_to_use": 1.5}, r"option 'cpu_bytes_to_use'=1.5: must be a positive whole"),
    ],
)
def test_options_refuse_bad_input(extra, message):
    with pytest.raises(ArgumentError, match=message):
        parse_options(extra)


def test_options_budget_order():
    assert parse_options({})[1] == DEFAULT_HOST_BYTES
    assert parse_options({"cpu_bytes_to_use": 1 << 20})[1] == 1 << 20
    assert parse_options({"cpu_bytes_to_use": 1 << 20, "kvforge": {"host_bytes": 7}})[1] == 7
