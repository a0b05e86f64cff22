"""Swap out / swap in round trips for every variant, host pools, hooks and error paths."""

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext

import pytest
import torch
from _helpers import grow
from hypothesis import given, settings
from hypothesis import strategies as st

from kvforge import (
    NULL_BLOCK,
    CacheController,
    DeepseekV4Backend,
    DSABackend,
    GQABackend,
    MLABackend,
    OutOfBlocksError,
    RequestStateError,
    SwapPurpose,
    TokenRange,
    ops,
)
from kvforge.verify import verify_request, write_request
from kvforge.worker import transfer as swap
from kvforge.worker.transfer import contiguous_runs


def flash_like(layers=43, kv_cache_dtype="fp8"):
    """DeepSeek-V4-Flash-shaped ratios ([0, 0] then 4/128 alternating) plus one MTP layer."""
    ratios = [0, 0] + [4 if i % 2 == 0 else 128 for i in range(layers - 2)] + [0]
    kinds = {r: DeepseekV4Backend(r, kv_cache_dtype=kv_cache_dtype) for r in (0, 4, 128)}
    return {layer: kinds[r] for layer, r in enumerate(ratios)}


MODELS = {
    "gqa": lambda: {i: GQABackend(4, 32, 16, "bfloat16") for i in range(3)},
    "gqa_block_wise_fp8": lambda: {
        i: GQABackend(4, 32, 16, kv_cache_quant="block_wise_fp8") for i in range(3)
    },
    "mla": lambda: {i: MLABackend(block_size=16) for i in range(3)},
    "dsa": lambda: {i: DSABackend(block_size=64) for i in range(3)},
    "deepseek_v4_flash_mtp": flash_like,
}


def scribble(ctl):
    for cache in ctl.kv_caches:
        cache.view(torch.uint8).fill_(0xA5)


@pytest.mark.parametrize("model", sorted(MODELS))
@pytest.mark.slow
def test_round_trip_every_variant(model):
    v4 = model.startswith("deepseek")
    ctl = CacheController(MODELS[model]())
    # 700 tokens take 17 live c128_state blocks (the last 128 tokens straddle 17 of 8)
    ctl.initialize_kv_cache(num_blocks=40 if v4 else 12)
    ctl.initialize_host_cache(num_pages=40 if v4 else 12)
    n = 700 if v4 else 150
    grow(ctl, "r", n)
    written = write_request(ctl, "r", seed=7, positions=range(n))
    assert written > 0
    before = {g: ctl.block_table("r", g) for g in ctl.groups}
    handle = ctl.swap_out("r")
    assert handle.done()
    handle.wait()
    assert all(ctl.num_used_blocks(g) == 0 for g in ctl.groups)
    grow(ctl, "blocker", 1)  # takes the lowest free ids so swap-in lands elsewhere
    scribble(ctl)
    back = ctl.swap_in("r")
    after = {g: ctl.block_table("r", g) for g in ctl.groups}
    assert after != before
    check = verify_request(ctl, "r", seed=7)
    assert (check.entries, check.mismatched) == (written, 0)
    assert back.bytes_moved == handle.bytes_moved > 0
    assert all(used == 0 for used, _ in ctl.host_pool_usage().values())
    ctl.free_request("r")
    ctl.free_request("blocker")
    ctl.free()
    assert ctl.device_bytes == 0 and ctl.host_bytes == 0


def test_flash_moves_only_live_window_and_state_blocks():
    ctl = CacheController(flash_like(layers=5))  # ratios 0, 0, 4, 128, 4 + MTP 0
    ctl.initialize_kv_cache(
        num_blocks={"swa": 8, "compressed": 8, "c4_state": 400, "c128_state": 200}
    )
    ctl.initialize_host_cache(
        num_pages={"swa": 8, "compressed": 8, "c4_state": 8, "c128_state": 20}
    )
    grow(ctl, "r", 1000)
    handle = ctl.swap_out("r")
    # swa: last 128 tokens (872..999) -> blocks 13..15 = 3; compressed: 1000 tokens -> 4 blocks;
    # c4_state: last 8 tokens (992..999) -> blocks 248, 249 = 2; c128_state: 872..999 -> 109..124 = 16
    assert handle.blocks_moved == {"swa": 3, "compressed": 4, "c4_state": 2, "c128_state": 16}
    page = {g: ctl.scheduler.page_bytes(g) for g in ctl.groups}
    # swa page: 6 layers * 37,376; compressed page: 2 ratio-4 layers (37,376 + 8,448) + 1 ratio-128 (1,168)
    assert page["swa"] == 6 * 37_376
    assert page["compressed"] == 2 * (37_376 + 8_448) + 1_168
    assert page["c4_state"] == 2 * 4 * (8_192 + 2_048)
    assert page["c128_state"] == 8 * 4_096
    assert handle.bytes_moved == sum(handle.blocks_moved[g] * page[g] for g in page)


def test_prefix_purpose_skips_state_groups():
    ctl = CacheController(flash_like(layers=4))
    ctl.initialize_kv_cache(num_blocks=64)
    ctl.initialize_host_cache(num_pages=64)
    grow(ctl, "r", 300)
    written = write_request(ctl, "r", seed=3, positions=range(300))
    handle = ctl.swap_out("r", purpose="prefix")
    assert set(handle.blocks_moved) == {"swa", "compressed"}
    scribble(ctl)
    ctl.swap_in("r")
    check = verify_request(ctl, "r", seed=3, skip_groups=("c4_state", "c128_state"))
    assert check.mismatched == 0 and 0 < check.entries < written
    # state blocks exist again (contents undefined): the request can keep decoding
    assert NULL_BLOCK not in ctl.block_table("r", "c4_state")[-2:]


def test_backend_can_override_selection_per_role():
    class KeepNoValue(GQABackend):
        def offload_selection(self, role, num_tokens, purpose):
            if role.name == "value" and purpose is SwapPurpose.PREFIX:
                return TokenRange(start=num_tokens, end=num_tokens)
            return super().offload_selection(role, num_tokens, purpose)

    calls = []

    class Hooked(KeepNoValue):
        def before_swap_out(self, ctx):
            calls.append(("out", ctx.request_id, ctx.layer_ids, dict(ctx.device_blocks)))

        def after_swap_in(self, ctx):
            calls.append(("in", ctx.request_id, ctx.layer_ids, dict(ctx.device_blocks)))

    hooked = Hooked(2, 8, 4)
    ctl = CacheController({0: hooked, 1: hooked})
    ctl.initialize_kv_cache(num_blocks=8)
    ctl.initialize_host_cache(num_pages=8)
    grow(ctl, "r", 10)
    ctl.swap_out("r", purpose="prefix")  # key still selected: the page (key and value) moves
    ctl.swap_in("r")
    assert calls[0] == ("out", "r", (0, 1), {"kv": [1, 2, 3]})
    assert calls[1][:3] == ("in", "r", (0, 1)) and len(calls[1][3]["kv"]) == 3

    class KeepNothing(GQABackend):
        def offload_selection(self, role, num_tokens, purpose):
            return TokenRange(start=num_tokens, end=num_tokens)

    ctl = CacheController({0: KeepNothing(2, 8, 4)})
    ctl.initialize_kv_cache(num_blocks=8)
    ctl.initialize_host_cache(num_pages=8)
    grow(ctl, "r", 10)
    assert ctl.swap_out("r").blocks_moved == {}

    class Broken(GQABackend):
        def offload_selection(self, role, num_tokens, purpose):
            return TokenRange(start=0, end=num_tokens + 5)

    ctl = CacheController({0: Broken(2, 8, 4)})
    ctl.initialize_kv_cache(num_blocks=8)
    ctl.initialize_host_cache(num_pages=8)
    grow(ctl, "r", 10)
    with pytest.raises(
        ValueError, match=r"offload_selection\('key', 10, 'preempt'\) returned .* within \[0, 10\)"
    ):
        ctl.swap_out("r")
    assert ctl.block_table("r", "kv") == [1, 2, 3]


def test_roles_not_offloaded_have_no_host_plane():
    from kvforge.attn_backends.base import DeclaredBackend
    from kvforge.specs import CacheGroup, CacheRole

    class Scratch(DeclaredBackend):
        def __init__(self):
            self.declare(
                [CacheGroup(name="kv", block_size=4)],
                [
                    CacheRole(name="key", group="kv", entry_shape=(8,), dtype="uint8"),
                    CacheRole(
                        name="scratch", group="kv", entry_shape=(8,), dtype="uint8", offload=False
                    ),
                ],
            )

    ctl = CacheController({0: Scratch()})
    ctl.initialize_kv_cache(num_blocks=4)
    ctl.initialize_host_cache(num_pages=4)
    assert ctl.storage.host.groups["kv"].page_bytes == 4 * 8
    assert set(ctl.host_kv_caches) == {("key", 0)}
    assert ctl.host_kv_caches[("key", 0)].shape == (4, 4, 8)


def test_host_views_alias_host_pages():
    ctl = CacheController({0: GQABackend(2, 4, 4, kv_cache_quant="block_wise_fp8")})
    ctl.initialize_kv_cache(num_blocks=4)
    ctl.initialize_host_cache(num_pages=3)
    views = ctl.host_kv_caches
    assert (
        views[("key", 0)].shape == (3, 4, 2, 4) and views[("key", 0)].dtype == torch.float8_e4m3fn
    )
    assert (
        views[("key_scale", 0)].shape == (3, 4, 2)
        and views[("key_scale", 0)].dtype == torch.float32
    )
    grow(ctl, "r", 4)
    write_request(ctl, "r", seed=1, positions=range(4))
    ctl.swap_out("r")
    # the key bytes of device block 1 are now the first 32 bytes of host page 1
    (page,) = [1]
    assert torch.equal(
        views[("key", 0)][page].view(torch.uint8).reshape(-1),
        ctl.storage.host.groups["kv"].pages[page, :32],
    )


def test_swap_errors_change_nothing():
    ctl = CacheController({0: GQABackend(2, 8, 4)})
    ctl.initialize_kv_cache(num_blocks=10)
    with pytest.raises(RuntimeError, match="call initialize_host_cache before swapping"):
        ctl.swap_out("r")
    ctl.initialize_host_cache(num_pages=3)  # 2 usable pages
    grow(ctl, "r", 12)  # 3 blocks
    with pytest.raises(
        OutOfBlocksError, match=r"swap_out: host group 'kv' needs 3 free blocks but has 2"
    ):
        ctl.swap_out("r")
    assert ctl.block_table("r", "kv") == [1, 2, 3] and ctl.host_pool_usage() == {"kv": (0, 2)}
    with pytest.raises(RequestStateError, match="request 'r' is not swapped out"):
        ctl.swap_in("r")
    with pytest.raises(RequestStateError, match="request 'zz' has no blocks on the device"):
        ctl.swap_out("zz")
    with pytest.raises(
        ValueError, match=r"purpose must be one of \['preempt', 'prefix'\], got 'later'"
    ):
        ctl.swap_out("r", purpose="later")
    ctl.free_request("r")
    grow(ctl, "s", 8)
    ctl.swap_out("s")
    with pytest.raises(RequestStateError, match="request 's' is already swapped out"):
        ctl.swap_out("s")
    with pytest.raises(RequestStateError, match="request 's' is swapped out; swap_in it first"):
        grow(ctl, "s", 9)
    grow(ctl, "big", 36)  # 9 blocks: all device blocks
    with pytest.raises(OutOfBlocksError, match="device group 'kv' needs 2 free blocks but has 0"):
        ctl.swap_in("s")
    assert ctl.is_swapped("s") and ctl.host_pool_usage() == {"kv": (2, 2)}
    ctl.free_request("s")  # a swapped request frees its host pages
    assert ctl.host_pool_usage() == {"kv": (0, 2)}
    with pytest.raises(RuntimeError, match="initialize_host_cache was already called"):
        ctl.initialize_host_cache(num_pages=3)


def test_host_memory_budget():
    ctl = CacheController({0: GQABackend(2, 8, 4)})
    ctl.initialize_kv_cache(num_blocks=4)
    page = 2 * 4 * 2 * 8 * 2  # k+v, 4 tokens, 2 heads, 8 dims, bf16
    plan = ctl.initialize_host_cache(memory_budget=10 * page)
    assert plan.num_blocks == {"kv": 10}
    assert ctl.host_bytes == 10 * page
    ctl.free()
    assert ctl.host_bytes == 0


def test_contiguous_runs():
    assert contiguous_runs([4, 5, 6, 9, 10, 2]) == [(0, 3, 4), (3, 5, 9), (5, 6, 2)]
    assert contiguous_runs([]) == []


class _Stream:
    """Stands in for an accelerator stream; copies are synchronous, so it only logs what it
    was told to wait for."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.waited_events: list[tuple[str, int]] = []
        self.waited_streams: list[str] = []

    def wait_event(self, event: tuple[str, int]) -> None:
        self.waited_events.append(event)

    def wait_stream(self, other: "_Stream") -> None:
        self.waited_streams.append(other.name)


class _StagedCpuPlatform:
    """CPU tensors driven through the accelerator branch of ``move_pages`` (staging slots,
    pipeline chunks, one DMA per contiguous run of host pages). Events are ``(stream, n)``:
    the n-th event recorded on that stream."""

    device = torch.device("cpu")

    def __init__(self) -> None:
        self.recorded: dict[str, int] = {}

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.full(shape, 0xEE, dtype=dtype)  # junk: a row never written shows up

    @contextmanager
    def side_stream(self, stream: _Stream) -> Iterator[None]:
        yield

    def stream_context(self, stream: _Stream) -> nullcontext:
        return nullcontext()

    def record_event(self, stream: _Stream) -> tuple[str, int]:
        self.recorded[stream.name] = self.recorded.get(stream.name, 0) + 1
        return (stream.name, self.recorded[stream.name])


def test_staged_pipeline_moves_every_chunk_and_run(monkeypatch):
    # 7 blocks of 3 planes (rows of 40 + 8 + 1168 = 1216 bytes) to host pages in three runs
    # ([2, 3], [6], [8, 9, 10, 11]); chunks of 2 rows (4 chunks) cut across the runs and take
    # the two staging slots in turns
    monkeypatch.setattr(swap, "PIPELINE_CHUNK_BYTES", 2 * 1216)
    gen = torch.Generator().manual_seed(3)
    tensors = [
        torch.randint(0, 256, (12, nb), dtype=torch.uint8, generator=gen) for nb in (40, 8, 1168)
    ]
    planes = ops.PlaneSet(tensors)
    device_ids = [9, 1, 4, 11, 0, 7, 5]
    page_ids = [2, 3, 6, 8, 9, 10, 11]
    pages = torch.zeros((12, 1216), dtype=torch.uint8)
    compute, copy = _Stream("compute"), _Stream("copy")
    streams = swap.SwapStreams(compute, copy)
    keep: list[torch.Tensor] = []
    platform = _StagedCpuPlatform()
    swap.move_pages("out", platform, streams, planes, device_ids, pages, page_ids, keep)
    expected = torch.zeros_like(pages)
    for b, page in zip(device_ids, page_ids, strict=True):
        expected[page] = torch.cat([t[b] for t in tensors])
    assert torch.equal(pages, expected)
    assert len(keep) == 1 and tuple(keep[0].shape) == (4, 1216)  # two slots of two rows
    # each DMA waits for its gather; the gathers of chunks 2 and 3 wait for the DMAs of
    # chunks 0 and 1 (the 1st and 2nd events on the copy stream) to drain their slots
    assert copy.waited_events == [("compute", k) for k in (1, 2, 3, 4)]
    assert compute.waited_events == [("copy", 1), ("copy", 2)]
    assert compute.waited_streams == ["copy"]

    originals = [t.clone() for t in tensors]
    for t in tensors:
        t.zero_()
    compute, copy = _Stream("compute"), _Stream("copy")
    platform = _StagedCpuPlatform()
    swap.move_pages(
        "in", platform, swap.SwapStreams(compute, copy), planes, device_ids, pages, page_ids, keep
    )
    for t, original in zip(tensors, originals, strict=True):
        assert torch.equal(t[device_ids], original[device_ids])
        untouched = [b for b in range(12) if b not in device_ids]
        assert not t[untouched].any()
    # the first DMA starts after the compute stream's earlier work; each scatter waits for
    # its DMA; the DMAs of chunks 2 and 3 wait for the scatters of chunks 0 and 1
    assert copy.waited_streams == ["compute"]
    assert compute.waited_events == [("copy", k) for k in (1, 2, 3, 4)]
    assert copy.waited_events == [("compute", 1), ("compute", 2)]


SMALL_V4 = {
    0: DeepseekV4Backend(
        0, head_dim=64, qk_rope_head_dim=16, index_head_dim=16, kv_cache_dtype="bf16"
    ),
    1: DeepseekV4Backend(4, head_dim=64, qk_rope_head_dim=16, index_head_dim=16),
    2: DeepseekV4Backend(128, head_dim=64, qk_rope_head_dim=16, index_head_dim=16),
}


@settings(max_examples=40, deadline=None)
@given(
    steps=st.lists(
        st.tuples(
            st.sampled_from(["grow", "out", "in", "free", "out_many", "in_many"]),
            st.integers(0, 3),
            st.integers(1, 200),
        ),
        max_size=25,
    )
)
def test_random_interleavings_lose_nothing(steps):
    ctl = CacheController(SMALL_V4)
    ctl.initialize_kv_cache(
        num_blocks={"swa": 10, "compressed": 6, "c4_state": 10, "c128_state": 40}
    )
    ctl.initialize_host_cache(
        num_pages={"swa": 8, "compressed": 5, "c4_state": 8, "c128_state": 36}
    )
    seeds: dict[str, int] = {}

    def usage() -> tuple[dict[str, int], dict[str, tuple[int, int]], list[str]]:
        used = {g: ctl.num_used_blocks(g) for g in ctl.groups}
        return used, ctl.host_pool_usage(), ctl.swapped_requests

    for op, rid, extra in steps:
        name = f"r{rid}"
        # batches: the requests whose bit is set in `extra`, in an order that depends on `rid`
        batch = sorted((r for r in seeds if extra >> int(r[1:]) & 1), key=lambda r: (r > name, r))
        before = usage()
        try:
            if op == "grow" and not ctl.is_swapped(name):
                old = ctl.num_tokens(name) if name in seeds else 0
                grow(ctl, name, old + extra)
                seeds[name] = rid
                write_request(ctl, name, rid, range(old, old + extra))
            elif op == "out" and name in seeds and not ctl.is_swapped(name):
                ctl.swap_out(name)
            elif op == "in" and ctl.is_swapped(name):
                ctl.swap_in(name)
            elif op == "free" and name in seeds:
                ctl.free_request(name)
                del seeds[name]
            elif op == "out_many":
                ctl.swap_out_many([r for r in batch if not ctl.is_swapped(r)])
            elif op == "in_many":
                ctl.swap_in_many([r for r in batch if ctl.is_swapped(r)])
        except OutOfBlocksError:
            assert usage() == before  # a refused swap or allocation changed nothing
        for r, seed in seeds.items():
            if not ctl.is_swapped(r):
                assert verify_request(ctl, r, seed).mismatched == 0
    for r in list(seeds):
        ctl.free_request(r)
    assert all(ctl.num_used_blocks(g) == 0 for g in ctl.groups)
    assert all(used == 0 for used, _ in ctl.host_pool_usage().values())


def test_batch_round_trip_matches_single_swaps():
    # three DeepSeek-V4-shaped requests of different lengths leave and come back in one call
    # per direction; every entry comes back, and the per-request handles report what a
    # single swap_out of that request reports
    ctl = CacheController(SMALL_V4)
    ctl.initialize_kv_cache(num_blocks=60)
    ctl.initialize_host_cache(num_pages=60)
    lengths = {"a": 300, "b": 41, "c": 700}
    written = {}
    for i, (r, n) in enumerate(lengths.items()):
        grow(ctl, r, n)
        written[r] = write_request(ctl, r, seed=i, positions=range(n))
    single = ctl.swap_out("a")
    ctl.swap_in("a")
    handles = ctl.swap_out_many(["a", "b", "c"])
    assert [h.request_id for h in handles] == ["a", "b", "c"]
    assert [h.num_tokens for h in handles] == [300, 41, 700]
    assert handles[0].bytes_moved == single.bytes_moved
    assert handles[0].blocks_moved == single.blocks_moved
    assert len({id(h.event) for h in handles}) == 1  # one event covers the batch
    assert all(ctl.num_used_blocks(g) == 0 for g in ctl.groups)
    assert ctl.swapped_requests == ["a", "b", "c"]
    grow(ctl, "blocker", 1)
    scribble(ctl)
    back = ctl.swap_in_many(["c", "a", "b"])
    assert [h.request_id for h in back] == ["c", "a", "b"]
    assert [h.bytes_moved for h in back] == [
        handles[2].bytes_moved,
        *(h.bytes_moved for h in handles[:2]),
    ]
    for i, r in enumerate(lengths):
        check = verify_request(ctl, r, seed=i)
        assert (check.entries, check.mismatched) == (written[r], 0)
    assert all(used == 0 for used, _ in ctl.host_pool_usage().values())
    assert ctl.stats.swaps_out == 4 and ctl.stats.swaps_in == 4
    assert ctl.stats.blocks_in == ctl.stats.blocks_out


def test_batch_errors_change_nothing():
    ctl = CacheController({0: GQABackend(2, 8, 4)})
    ctl.initialize_kv_cache(num_blocks=10)  # 9 usable
    ctl.initialize_host_cache(num_pages=6)  # 5 usable pages
    grow(ctl, "a", 8)  # 2 blocks
    grow(ctl, "b", 12)  # 3 blocks
    grow(ctl, "c", 4)  # 1 block
    tables = {r: ctl.block_table(r, "kv") for r in "abc"}
    with pytest.raises(
        OutOfBlocksError, match=r"swap_out: host group 'kv' needs 6 free blocks but has 5"
    ):
        ctl.swap_out_many(["a", "b", "c"])
    with pytest.raises(ValueError, match="request_ids lists 'a' twice"):
        ctl.swap_out_many(["a", "c", "a"])
    with pytest.raises(TypeError, match="request_ids must be a sequence of request ids, got str"):
        ctl.swap_out_many("ab")
    with pytest.raises(RequestStateError, match="request 'zz' has no blocks on the device"):
        ctl.swap_out_many(["a", "zz"])
    assert {r: ctl.block_table(r, "kv") for r in "abc"} == tables
    assert ctl.host_pool_usage() == {"kv": (0, 5)} and ctl.swapped_requests == []

    ctl.swap_out_many(["a", "b"])
    assert ctl.host_pool_usage() == {"kv": (5, 5)}
    with pytest.raises(RequestStateError, match="request 'c' is not swapped out"):
        ctl.swap_in_many(["a", "c"])
    grow(ctl, "big", 20)  # 5 blocks: 1 + 5 = 6 used, 3 free; a + b need 5
    with pytest.raises(
        OutOfBlocksError, match="swap_in: device group 'kv' needs 5 free blocks but has 3"
    ):
        ctl.swap_in_many(["a", "b"])
    assert ctl.swapped_requests == ["a", "b"] and ctl.num_used_blocks("kv") == 6
    assert ctl.host_pool_usage() == {"kv": (5, 5)}
    ctl.free_request("big")
    ctl.swap_in_many(["b", "a"])
    assert ctl.host_pool_usage() == {"kv": (0, 5)} and ctl.num_used_blocks("kv") == 6


def test_failing_hook_gives_host_pages_back():
    class Refuses(GQABackend):
        def before_swap_out(self, ctx):
            if ctx.request_id == "b":
                raise RuntimeError("not now")

    ctl = CacheController({0: Refuses(2, 8, 4)})
    ctl.initialize_kv_cache(num_blocks=10)
    ctl.initialize_host_cache(num_pages=10)
    grow(ctl, "a", 8)
    grow(ctl, "b", 8)
    with pytest.raises(RuntimeError, match="not now"):
        ctl.swap_out_many(["a", "b"])
    assert ctl.host_pool_usage() == {"kv": (0, 9)} and ctl.swapped_requests == []
    assert ctl.num_used_blocks("kv") == 4


def test_failing_after_swap_in_hook_rolls_the_batch_back():
    class Complains(GQABackend):
        def after_swap_in(self, ctx):
            if ctx.request_id == "a":
                raise RuntimeError("resume failed")

    ctl = CacheController({0: Complains(2, 8, 4)})
    ctl.initialize_kv_cache(num_blocks=10)
    ctl.initialize_host_cache(num_pages=10)
    for r in "ab":
        grow(ctl, r, 8)
    written = {r: write_request(ctl, r, seed=i, positions=range(8)) for i, r in enumerate("ab")}
    ctl.swap_out_many(["a", "b"])
    with pytest.raises(RuntimeError, match="resume failed"):
        ctl.swap_in_many(["a", "b"])
    # the worker reported the failure; the scheduler side gave the new device blocks back and
    # both requests are still swapped out, their host pages intact
    assert ctl.swapped_requests == ["a", "b"] and ctl.host_pool_usage() == {"kv": (4, 9)}
    assert ctl.num_used_blocks("kv") == 0
    Complains.after_swap_in = GQABackend.after_swap_in  # the engine fixes the cause, retries
    ctl.swap_in_many(["a", "b"])
    assert ctl.host_pool_usage() == {"kv": (0, 9)}
    for i, r in enumerate("ab"):
        check = verify_request(ctl, r, seed=i)
        assert (check.entries, check.mismatched) == (written[r], 0)


def test_swap_in_many_failing_midway_changes_nothing(monkeypatch):
    ctl = CacheController(SMALL_V4)
    ctl.initialize_kv_cache(num_blocks=40)
    ctl.initialize_host_cache(num_pages=40)
    grow(ctl, "a", 300)
    written = write_request(ctl, "a", seed=5, positions=range(300))
    ctl.swap_out("a")
    used = {g: ctl.num_used_blocks(g) for g in ctl.groups}
    calls = []
    real = swap.move_pages

    def fails_on_second_group(*args, **kwargs):
        calls.append(args[0])
        if len(calls) == 2:
            raise MemoryError("staging")
        return real(*args, **kwargs)

    monkeypatch.setattr("kvforge.worker.swap_execution.move_pages", fails_on_second_group)
    with pytest.raises(MemoryError, match="staging"):
        ctl.swap_in("a")
    assert {g: ctl.num_used_blocks(g) for g in ctl.groups} == used
    assert ctl.is_swapped("a") and ctl.swapped_requests == ["a"]
    monkeypatch.undo()
    ctl.swap_in("a")  # the host pages were only read: the retry brings everything back
    check = verify_request(ctl, "a", seed=5)
    assert (check.entries, check.mismatched) == (written, 0)


def test_swap_in_batch_checks_everything_first():
    ctl = CacheController({0: GQABackend(2, 8, 4)})
    ctl.initialize_kv_cache(num_blocks=8)  # 7 usable
    ctl.initialize_host_cache(num_pages=8)
    grow(ctl, "x", 12)  # 3 blocks
    grow(ctl, "y", 12)
    ctl.swap_out_many(["x", "y"])
    grow(ctl, "z", 8)  # 2 blocks: 5 free, x + y need 6
    for batch, exc, message in [
        (["x", "x"], ValueError, "request_ids lists 'x' twice"),
        (["x", "z"], RequestStateError, "request 'z' is not swapped out (swapped out: ['x', 'y'])"),
        (
            ["x", "y"],
            OutOfBlocksError,
            "swap_in: device group 'kv' needs 6 free blocks but has 5; nothing was allocated",
        ),
        (["x", ""], RequestStateError, "request_id must be a non-empty str, got ''"),
    ]:
        with pytest.raises(exc) as info:
            ctl.swap_in_many(batch)
        assert str(info.value) == message
        assert ctl.num_used_blocks("kv") == 2 and ctl.requests == ["z"]
        assert ctl.swapped_requests == ["x", "y"] and ctl.host_pool_usage() == {"kv": (6, 7)}


def test_evict_from_caches_rejects_views_it_cannot_flush():
    fast = pytest.importorskip("kvforge.ops.cpu_fast")
    if not fast.can_evict():
        pytest.skip("clflush needs x86-64")
    t = torch.arange(64, dtype=torch.int64)
    fast.evict_from_caches([t])
    assert torch.equal(t, torch.arange(64, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"tensors\[1\] must be a contiguous cpu tensor"):
        fast.evict_from_caches([t, torch.zeros(1, dtype=torch.uint8).expand(1 << 34)])
    with pytest.raises(ValueError, match=r"tensors\[0\] must be a contiguous cpu tensor"):
        fast.evict_from_caches([t.view(8, 8)[:, 1]])
