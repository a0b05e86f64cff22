"""Threads: each side serialises its public methods, the two sides run concurrently, and no
operation interleaving leaks a block or a page; plus refusals that leave a controller ready
to retry (validation before anything is stored)."""

from __future__ import annotations

import contextlib
import threading

import pytest
import torch

from kvforge import CacheController, GQABackend, OutOfBlocksError, RequestStateError
from kvforge.specs import CacheRole
from kvforge.verify import verify_request, write_request


def test_two_threads_sharing_a_controller_lose_nothing():
    ctl = CacheController({i: GQABackend(2, 16, 16) for i in range(2)})
    ctl.initialize_kv_cache(num_blocks=64)
    ctl.initialize_host_cache(num_pages=64)
    errors: list[BaseException] = []
    seeds = {f"s{i}": 100 + i for i in range(4)}

    def swapper() -> None:  # preempts and resumes its own requests over and over
        try:
            for rid, seed in seeds.items():
                ctl.allocate(rid, 40)
                write_request(ctl, rid, seed, range(40))
            for _ in range(40):
                for rid in seeds:
                    ctl.swap_out(rid)
                for rid in seeds:
                    ctl.swap_in(rid)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    def allocator() -> None:  # grows and frees others meanwhile
        try:
            for k in range(300):
                rid = f"a{k % 5}"
                with contextlib.suppress(OutOfBlocksError, ValueError):
                    ctl.allocate(rid, 8 + k % 50)
                if k % 3 == 0 and rid in ctl.requests:
                    ctl.free_request(rid)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=swapper), threading.Thread(target=allocator)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    for rid, seed in seeds.items():
        assert verify_request(ctl, rid, seed).mismatched == 0
    ctl.free_requests(ctl.requests)
    assert ctl.num_used_blocks("kv") == 0
    assert ctl.host_pool_usage() == {"kv": (0, 63)}


def test_scheduler_and_worker_sides_run_concurrently():
    # the worker side computes a step's inputs while the scheduler side plans the next one
    ctl = CacheController({0: GQABackend(1, 8, 16)})
    ctl.initialize_kv_cache(num_blocks=200)
    manager, storage = ctl.scheduler, ctl.storage
    steps = [manager.schedule([f"r{i}" for i in range(8)], [16] * 8)]
    done = threading.Event()

    def worker() -> None:
        for step in steps[:1]:
            storage.apply(step)
        done.set()

    t = threading.Thread(target=worker)
    t.start()
    steps += [manager.schedule([f"r{i}" for i in range(8)], [1] * 8) for _ in range(20)]
    t.join(30)
    assert done.is_set()
    for step in steps[1:]:
        storage.apply(step)
    for i in range(8):
        row = manager.row_of(f"r{i}")
        assert (storage.block_table("kv")[row] == manager.table("kv")[row]).all()


def test_a_refused_create_leaves_the_controller_retryable():
    class Shared(GQABackend):
        """Key and value carved from one buffer: they would overwrite each other."""

        def create_kv_cache(self, layer_ids, num_blocks, device):
            caches = super().create_kv_cache(layer_ids, num_blocks, device)
            for layer in layer_ids:
                caches[("value", layer)] = caches[("key", layer)]
            return caches

    ctl = CacheController({0: Shared(1, 8, 16)})
    with pytest.raises(
        ValueError, match=r"buffers 'key_caches_0_rank0.device0' and 'value_caches_0"
    ):
        ctl.initialize_kv_cache(num_blocks=8)
    assert "declared" in repr(ctl) and ctl.device_bytes == 0
    with pytest.raises(RuntimeError, match="call initialize_kv_cache before using the caches"):
        ctl.allocate("a", 4)
    Shared.create_kv_cache = GQABackend.create_kv_cache  # fixed: the retry succeeds
    ctl.initialize_kv_cache(num_blocks=8)
    assert "ready" in repr(ctl)


def test_host_cache_with_nothing_to_offload_is_refused_at_once():
    class Pinned(GQABackend):
        def cache_roles(self):
            return [
                CacheRole(**{**r.model_dump(), "offload": False}) for r in super().cache_roles()
            ]

    ctl = CacheController({0: Pinned(1, 8, 16)})
    ctl.initialize_kv_cache(num_blocks=8)
    for kwargs in ({"memory_budget": 1 << 20}, {"num_pages": 4}):
        with pytest.raises(ValueError, match="no role of any group is offloaded"):
            ctl.initialize_host_cache(**kwargs)
    with pytest.raises(RuntimeError, match="call initialize_host_cache before swapping"):
        ctl.swap_out("nope")


def test_wrong_values_are_refused():
    ctl = CacheController({0: GQABackend(1, 8, 16), 1: GQABackend(1, 8, 16)})
    ctl.initialize_kv_cache(num_blocks=8)
    ctl.allocate("a", 10)
    for positions in ([1.5, 2.7], [True, False], torch.tensor([1.0])):
        with pytest.raises(ValueError, match="positions must be"):
            ctl.slot_mapping("a", "kv", positions)
    with pytest.raises(KeyError, match="layer must be an int, got True"):
        ctl.index_of("key", True)
    with pytest.raises(
        ValueError, match="num_blocks\\['kv'\\]=10,000,000,000,000,000,000,000 is more blocks"
    ):
        CacheController({0: GQABackend(1, 8, 16)}).initialize_kv_cache(num_blocks=10**22)
    with pytest.raises(RequestStateError, match="request_id must be a non-empty str"):
        ctl.allocate("", 4)
