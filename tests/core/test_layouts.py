"""Device layouts as attention kernels expect them: padded (strided) blocks, head-major blocks,
engine-packed allocations, moved byte-exact by every gather/scatter implementation.

Every round trip writes distinct bytes through the declared layout (``kvforge.verify``), swaps
out, scribbles over the device blocks, swaps in and compares every live entry; padding bytes
hold a sentinel from the start and must hold it at the end (no kernel may address them).
"""

from __future__ import annotations

import functools

import pytest
import torch
from _helpers import grow

import kvforge.ops as ops
from kvforge import CacheController, DeepseekV4Backend, GQABackend
from kvforge.attn_backends.base import DeclaredBackend, padded_block_view
from kvforge.specs import CacheGroup, CacheRole
from kvforge.verify import read_entries, verify_request, write_request
from kvforge.worker.transfer import plane_bytes

SENTINEL = 0x5C
SCRIBBLE = 0xA5


def _has(impl: str) -> bool:
    return impl in ops.available_impls("cpu")


IMPLS = [
    "torch",
    pytest.param("cpu", marks=pytest.mark.skipif(not _has("cpu"), reason="numba missing")),
    pytest.param(
        "triton", marks=pytest.mark.skipif(not _has("triton"), reason="triton interpreter off")
    ),
]


@pytest.fixture
def force_impl(monkeypatch):
    """Make the controller's swaps run ``impl`` (it calls ``ops.gather_blocks`` /
    ``ops.scatter_blocks`` with ``impl="auto"``); returns the impls the calls asked for."""
    used: list[str] = []

    def force(impl: str) -> list[str]:
        for name in ("gather_blocks", "scatter_blocks"):
            original = getattr(ops, name)

            @functools.wraps(original)
            def forced(*args, _original=original, **kwargs):
                kwargs["impl"] = impl
                used.append(impl)
                return _original(*args, **kwargs)

            monkeypatch.setattr(ops, name, forced)
        return used

    return force


def full_rows(cache: torch.Tensor) -> torch.Tensor:
    """``uint8 [num_blocks, block_stride]``: every byte of every block, padding included."""
    plane = plane_bytes(cache)
    rows = torch.empty(0, dtype=torch.uint8)
    rows.set_(
        cache.untyped_storage(),
        cache.storage_offset() * cache.element_size(),
        (plane.shape[0], plane.stride(0)),
        (plane.stride(0), 1),
    )
    return rows


def padding(cache: torch.Tensor) -> torch.Tensor:
    """The padding bytes after each block (a copy), ``[num_blocks, stride - block_bytes]``."""
    plane = plane_bytes(cache)
    return full_rows(cache)[:, plane.shape[1] :].clone()


class PaddedHeadMajor(DeclaredBackend):
    """Head-major float16 entries ``(4 heads, 24)`` in 16-token blocks padded to 1,000 B:
    16 * 4 * 24 * 2 = 3,072 meaningful bytes, cdiv(3,072, 1,000) * 1,000 = 4,000 B stride."""

    def __init__(self) -> None:
        self.declare(
            [CacheGroup(name="kv", block_size=16)],
            [
                CacheRole(
                    name=name,
                    group="kv",
                    entry_shape=(4, 24),
                    dtype="float16",
                    block_layout="head_major",
                    block_alignment=1000,
                )
                for name in ("key", "value")
            ],
        )


MODELS = {
    # fp8 V4, every role padded to 576 B (37,376 -> 37,440, 8,448 -> 8,640, ...)
    "v4_padded": (
        lambda: {0: DeepseekV4Backend(0), 1: DeepseekV4Backend(4), 2: DeepseekV4Backend(128)},
        40,
        300,
    ),
    # bf16 V4: bf16 kv padded (65,536 -> 65,664 B), uint8 indexer, float32 states
    "v4_bf16_padded": (
        lambda: {0: DeepseekV4Backend(4, kv_cache_dtype="bf16")},
        40,
        300,
    ),
    # FastDeploy layout: [blocks, kv_heads, B, head_dim] fp8 + bf16 [blocks, kv_heads, B, 1]
    "gqa_head_major": (
        lambda: dict.fromkeys(
            range(2),
            GQABackend(
                4,
                32,
                16,
                kv_cache_quant="block_wise_fp8",
                block_layout="head_major",
                scale_dtype="bfloat16",
            ),
        ),
        12,
        150,
    ),
    "head_major_padded": (lambda: dict.fromkeys(range(2), PaddedHeadMajor()), 12, 150),
}


def fill_padding(ctl: CacheController) -> int:
    """Put the sentinel in every padding byte; returns how many padding bytes there are."""
    total = 0
    for cache in ctl.kv_caches:
        plane = plane_bytes(cache)
        full_rows(cache)[:, plane.shape[1] :].fill_(SENTINEL)
        total += plane.shape[0] * (plane.stride(0) - plane.shape[1])
    return total


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("model", sorted(MODELS))
def test_round_trip_through_the_declared_layout(model, impl, force_impl):
    build, blocks, n = MODELS[model]
    used = force_impl(impl)
    ctl = CacheController(build())
    ctl.initialize_kv_cache(num_blocks=blocks)
    ctl.initialize_host_cache(num_pages=blocks)
    padded = fill_padding(ctl)
    assert (padded > 0) == (model != "gqa_head_major")
    grow(ctl, "r", n)
    written = write_request(ctl, "r", seed=11, positions=range(n))
    assert written > 0
    out = ctl.swap_out("r")
    grow(ctl, "blocker", 1)  # takes the lowest free ids so the swap in lands elsewhere
    for cache in ctl.kv_caches:
        plane_bytes(cache).fill_(SCRIBBLE)  # meaningful bytes only
    back = ctl.swap_in("r")
    check = verify_request(ctl, "r", seed=11)
    assert (check.entries, check.mismatched) == (written, 0)
    # host pages carry meaningful bytes only: one page per moved block, packed
    assert (
        back.bytes_moved
        == out.bytes_moved
        == sum(out.blocks_moved[g] * ctl.layout.host_page_bytes(g) for g in out.blocks_moved)
    )
    for cache in ctl.kv_caches:
        assert bool((padding(cache) == SENTINEL).all())
    assert used and set(used) == {impl}
    ctl.free()


def test_head_major_entries_are_not_contiguous():
    """A token-major reader of a head-major cache reads the wrong bytes: the layout is real."""
    ctl = CacheController(MODELS["gqa_head_major"][0]())
    ctl.initialize_kv_cache(num_blocks=4)
    ctl.allocate("r", 20)
    write_request(ctl, "r", seed=3, positions=range(20))
    entry = ctl.layout.entry("key", 0)
    key = ctl.get("key", 0)
    slot = int(ctl.slot_mapping("r", "kv", [17], 1)[0])
    block, within = divmod(slot, 16)
    # one token of head-major key [blocks, 4 heads, 16, 32]: 4 runs of 32 B, 16 * 32 B apart
    token = key[block, :, within]
    assert token.shape == (4, 32) and token.stride() == (16 * 32, 1)
    assert not token.is_contiguous()
    want = read_entries(key, entry, torch.tensor([slot]))[0]
    assert torch.equal(want, token.view(torch.uint8).reshape(-1))
    flat = plane_bytes(key)[block, within * 128 : (within + 1) * 128]
    assert not torch.equal(flat, want)  # a token-major writer or reader would be caught


def test_create_kv_cache_pads_with_strided_zeroed_views():
    backend = DeepseekV4Backend(4)
    caches = backend.create_kv_cache([5], {"swa": 2, "compressed": 3, "c4_state": 4}, "cpu")
    state = caches[("compressor_state", 5)]
    # [4 blocks, 4 tokens, 2048 float32], block stride 32,832 B = 8,208 elements
    assert state.shape == (4, 4, 2048) and state.stride() == (8208, 2048, 1)
    assert state.untyped_storage().nbytes() == 4 * 32_832  # one buffer, padding included
    assert bool((full_rows(state) == 0).all())
    plane = plane_bytes(state)
    assert (plane.shape, plane.stride()) == ((4, 32_768), (32_832, 1))
    assert plane.data_ptr() == state.data_ptr()
    unpadded = DeepseekV4Backend(4, block_alignment=1)
    flat = unpadded.create_kv_cache([0], {"swa": 2, "compressed": 3, "c4_state": 4}, "cpu")
    assert flat[("compressor_state", 0)].is_contiguous()


def test_storage_planes_carry_the_device_stride():
    ctl = CacheController({0: DeepseekV4Backend(4)})
    ctl.initialize_kv_cache(num_blocks=3)
    planes = ctl.storage.planes("compressed")
    # compressed_kv then indexer: 37,376 B at a 37,440 B stride, 8,448 B at 8,640 B
    assert [(tuple(p.shape), p.stride()) for p in planes] == [
        ((3, 37_376), (37_440, 1)),
        ((3, 8_448), (8_640, 1)),
    ]


class PackedIndexer(DeclaredBackend):
    """An indexer stored as two roles an engine carves from one ``[blocks, 8704]`` buffer:
    keys ``[blocks, 64, 128]`` uint8 (8,192 B) then scales ``[blocks, 64, 4]`` (256 B), then
    256 B of the engine's padding (8,704 = 17 * 512)."""

    def __init__(self) -> None:
        self.declare(
            [CacheGroup(name="kv", block_size=64)],
            [
                CacheRole(name="indexer_key", group="kv", entry_shape=(128,), dtype="uint8"),
                CacheRole(name="indexer_scale", group="kv", entry_shape=(4,), dtype="uint8"),
            ],
        )


def engine_buffers(num_blocks: int, layers: int = 2):
    buffers, caches = [], {}
    backend = PackedIndexer()
    group = backend.cache_groups()[0]
    for layer in range(layers):
        raw = torch.full((num_blocks, 8704), SENTINEL, dtype=torch.uint8)
        buffers.append(raw)
        caches[("indexer_key", layer)] = raw[:, :8192].view(num_blocks, 64, 128)
        scale_role = backend.role("indexer_scale")
        caches[("indexer_scale", layer)] = padded_block_view(raw, scale_role, group, offset=8192)
    return backend, buffers, caches


@pytest.mark.parametrize("impl", IMPLS)
def test_engine_packed_buffer_adopted_and_round_tripped(impl, force_impl):
    used = force_impl(impl)
    backend, buffers, caches = engine_buffers(10)
    ctl = CacheController(dict.fromkeys(range(2), backend))
    plan = ctl.adopt_kv_cache(caches)
    assert plan.num_blocks == {"kv": 10}
    assert ctl.get("indexer_scale", 1).data_ptr() == buffers[1].data_ptr() + 8192
    assert [p.stride() for p in ctl.storage.planes("kv")] == [(8704, 1)] * 4
    ctl.initialize_host_cache(num_pages=10)
    assert ctl.layout.host_page_bytes("kv") == 2 * (8192 + 256)
    grow(ctl, "r", 300)
    written = write_request(ctl, "r", seed=5, positions=range(300))
    assert written == 2 * 2 * 300
    ctl.swap_out("r")
    grow(ctl, "blocker", 1)
    for cache in ctl.kv_caches:
        plane_bytes(cache).fill_(SCRIBBLE)
    ctl.swap_in("r")
    check = verify_request(ctl, "r", seed=5)
    assert (check.entries, check.mismatched) == (written, 0)
    for raw in buffers:  # the engine's padding after each block is untouched
        assert bool((raw[:, 8448:] == SENTINEL).all())
    assert used and set(used) == {impl}


def test_adopt_refuses_a_block_that_is_not_one_run():
    backend, buffers, caches = engine_buffers(4)
    # keys interleaved with scales per token: [blocks, 64, 136] of which 128 are the key
    interleaved = buffers[0][:, : 64 * 136].view(4, 64, 136)
    caches[("indexer_key", 0)] = interleaved[:, :, :128]
    ctl = CacheController(dict.fromkeys(range(2), backend))
    with pytest.raises(
        ValueError,
        match=r"plane 'indexer_key_caches_0_rank0.device0': a block of shape \(64, 128\) with "
        r"element strides \(136, 1\) is not one contiguous run of bytes",
    ):
        ctl.adopt_kv_cache(caches)
    assert not ctl.storage.ready
    _, _, good = engine_buffers(4)
    assert ctl.adopt_kv_cache(good).num_blocks == {"kv": 4}  # nothing was kept: retryable


@pytest.mark.parametrize(
    ("tensor", "exc", "message"),
    [
        (torch.zeros(()), ValueError, "cache is a 0-d tensor"),
        (
            torch.zeros(3, 4, 8)[:, :, :4],
            ValueError,
            r"cache of shape \(3, 4, 4\) with element strides \(32, 8, 1\) is not block-major",
        ),
        (
            torch.zeros(1, 4).expand(3, 4),
            ValueError,
            r"shape \(3, 4\) with element strides \(0, 1\) has blocks that overlap: block "
            r"stride 0 bytes < 16 bytes per block",
        ),
        ([1, 2], TypeError, "cache must be a torch.Tensor, got list"),
    ],
)
def test_plane_bytes_refusals(tensor, exc, message):
    with pytest.raises(exc, match=message):
        plane_bytes(tensor)


@pytest.mark.parametrize(
    ("tensor", "shape", "stride", "offset"),
    [
        (torch.zeros(3, 4, 8, dtype=torch.float16), (3, 64), (64, 1), 0),
        # a permuted but dense block is still one run of bytes
        (torch.zeros(3, 8, 4, dtype=torch.float16).transpose(1, 2), (3, 64), (64, 1), 0),
        # carved from a wider row: keys then scales of one [5, 8704] buffer
        (
            torch.zeros(5, 8704, dtype=torch.uint8)[:, 8192:8448].view(5, 64, 4),
            (5, 256),
            (8704, 1),
            8192,
        ),
        # a single block: its stride is the block itself
        (torch.zeros(8, 10, dtype=torch.float32)[:1, :], (1, 40), (40, 1), 0),
        (torch.zeros(0, 4, 3), (0, 48), (48, 1), 0),
    ],
)
def test_plane_bytes_views(tensor, shape, stride, offset):
    plane = plane_bytes(tensor)
    assert (tuple(plane.shape), plane.stride(), plane.dtype) == (shape, stride, torch.uint8)
    base = tensor._base if tensor._base is not None else tensor
    if plane.numel():
        assert plane.data_ptr() == base.data_ptr() + offset
        plane.fill_(7)  # shares memory with the cache
        sevens = torch.full((tensor.element_size(),), 7, dtype=torch.uint8).view(tensor.dtype)
        assert bool((tensor == sevens).all())


GROUP = CacheGroup(name="g", block_size=4)
F32 = CacheRole(name="s", group="g", entry_shape=(3,), dtype="float32")


@pytest.mark.parametrize(
    ("raw", "offset", "message"),
    [
        (torch.zeros(2, 64, dtype=torch.int8), 0, "raw must be a uint8 .* got torch.int8"),
        (torch.zeros(2, 3, 64, dtype=torch.uint8), 0, r"shape \(2, 3, 64\)"),
        (torch.zeros(2, 64, dtype=torch.uint8), 20, "needs 48 bytes per block from offset 20"),
        (torch.zeros(2, 62, dtype=torch.uint8), 0, "row stride 62 and offset 0: not whole"),
        (torch.zeros(2, 64, dtype=torch.uint8), 2, "row stride 64 and offset 2: not whole"),
        (torch.zeros(2, 64, dtype=torch.uint8), -4, "offset must be an int >= 0, got -4"),
    ],
)
def test_padded_block_view_refusals(raw, offset, message):
    with pytest.raises(ValueError, match=message):
        padded_block_view(raw, F32, GROUP, offset=offset)
    assert bool((raw == 0).all())


def test_padded_block_view_addresses_only_its_bytes():
    raw = torch.zeros(3, 64, dtype=torch.uint8)
    view = padded_block_view(raw, F32, GROUP, offset=8)
    # 4 entries of 3 float32 = 48 B from byte 8 of each 64-byte row: 16 elements apart
    assert (view.shape, view.stride()) == ((3, 4, 3), (16, 3, 1))
    view.fill_(1.0)
    ones = torch.tensor([0, 0, 0x80, 0x3F], dtype=torch.uint8).repeat(12)
    assert bool((raw[:, 8:56] == ones).all())
    assert bool((raw[:, :8] == 0).all()) and bool((raw[:, 56:] == 0).all())
