"""The device buffers and swap executor a CacheStorage owns (kvforge.worker.device_buffers,
kvforge.worker.swap_execution), driven directly: the builder hands back checked buffers and
keeps nothing, a refused adopt changes nothing, ``device_bytes`` pays a shared pool once, and
an executor with nothing in flight orders, waits and closes without an event on CPU.

The layout is the small gpt-oss shaped one of ``tests/scheduler/test_shared_pools.py``: layers
0 and 2 slide (group ``swa``), layers 1 and 3 attend to everything (group ``kv``), GQA with 2
kv heads of dim 8 in bf16 and 16-token blocks, so one buffer block is 512 B and the two groups
form one pool set."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from kvforge import GQABackend
from kvforge.core.layout import CacheLayout
from kvforge.core.values import SwapPlan
from kvforge.worker import CacheStorage
from kvforge.worker.device_buffers import BufferBuilder, DeviceBuffers, device_bytes
from kvforge.worker.swap_execution import SwapExecutor, require_host

BUFFER_BLOCK = 16 * 2 * 8 * 2  # tokens * heads * dims * bytes = 512 B
BLOCKS = {"swa": 6, "kv": 6}


def layout() -> CacheLayout:
    swa = GQABackend(2, 8, block_size=16, sliding_window=32)
    kv = GQABackend(2, 8, block_size=16)
    return CacheLayout({0: swa, 1: kv, 2: swa, 3: kv})


def builder(lay: CacheLayout) -> BufferBuilder:
    storage = CacheStorage(lay, "cpu")
    return BufferBuilder(lay, storage.device, storage.names)


@pytest.mark.parametrize("share_pools", [True, False])
def test_create_hands_back_checked_buffers_in_layout_order(share_pools: bool) -> None:
    lay = layout()
    made = builder(lay).create(BLOCKS, share_pools=share_pools)
    assert isinstance(made, DeviceBuffers)
    assert [tuple(t.shape) for t in made.caches] == [(6, 16, 2, 8)] * len(lay.buffers)
    assert made.num_blocks == BLOCKS and made.share_pools is share_pools and made.arena is None
    assert sorted(made.planes) == ["kv", "swa"]
    # a shared pool's k-th buffers are one allocation: 8 buffers in 4 allocations
    bases = {t.data_ptr() for t in made.caches}
    assert len(bases) == (4 if share_pools else 8)
    expected = (4 if share_pools else 8) * 6 * BUFFER_BLOCK
    assert device_bytes(lay, made.caches, None) == expected
    storage = CacheStorage(lay, "cpu")
    storage.create(BLOCKS, max_num_seqs=2, max_model_len=64, share_pools=share_pools)
    assert storage.device_bytes == expected


def test_adopt_keeps_the_engine_tensors() -> None:
    lay = layout()
    made = builder(lay).create(BLOCKS, share_pools=True)
    engine = {e.key: made.caches[e.index] for e in lay.buffers}
    adopted = builder(lay).adopt(engine, share_pools=True)
    assert adopted.num_blocks == BLOCKS
    assert all(a is b for a, b in zip(adopted.caches, made.caches, strict=True))
    # the same aliasing tensors refused when pools may not share bytes
    with pytest.raises(ValueError, match="share bytes"):
        builder(lay).adopt(engine, share_pools=False)


def _engine(lay: CacheLayout) -> dict[tuple[str, int], torch.Tensor]:
    return {e.key: torch.zeros(6, 16, 2, 8, dtype=torch.bfloat16) for e in lay.buffers}


def _with(key: tuple[str, int], value: Any) -> Callable[[CacheLayout], Any]:
    def make(lay: CacheLayout) -> Any:
        caches: dict[Any, Any] = _engine(lay)
        caches[key] = value
        return caches

    return make


def _without(key: tuple[str, int]) -> Callable[[CacheLayout], Any]:
    def make(lay: CacheLayout) -> Any:
        caches = _engine(lay)
        del caches[key]
        return caches

    return make


def _aliased(lay: CacheLayout) -> Any:
    caches = _engine(lay)
    caches[("value", 1)] = caches[("key", 1)]
    return caches


# (case, caches made from the layout, share_pools, exception, message fragment)
BAD_ADOPTS = [
    ("not a mapping", lambda lay: list(_engine(lay).values()), True, TypeError, "must map"),
    ("share_pools not a bool", _engine, "yes", TypeError, "share_pools"),
    ("missing key", _without(("key", 3)), True, ValueError, "missing [('key', 3)]"),
    ("extra key", _with(("key", 9), torch.zeros(6, 16, 2, 8)), True, ValueError, "unexpected"),
    ("0-dim tensor", _with(("key", 0), torch.tensor(1.0)), True, ValueError, "block-major"),
    ("not a tensor", _with(("key", 0), [1, 2]), True, ValueError, "block-major"),
    (
        "roles of one group disagree",
        _with(("value", 0), torch.zeros(5, 16, 2, 8, dtype=torch.bfloat16)),
        True,
        ValueError,
        "has 5 blocks but other caches of group 'swa' have 6",
    ),
    (
        "pool members disagree",
        lambda lay: {
            **_engine(lay),
            **{
                e.key: torch.zeros(5, 16, 2, 8, dtype=torch.bfloat16)
                for e in lay.buffers
                if e.group.name == "kv"
            },
        },
        True,
        ValueError,
        "adopt: the caches hold",
    ),
    (
        "wrong dtype",
        _with(("key", 2), torch.zeros(6, 16, 2, 8, dtype=torch.float32)),
        True,
        ValueError,
        "adopt: cache ('key', 2) shape (6, 16, 2, 8) dtype torch.float32",
    ),
    (
        "wrong block shape",
        _with(("key", 2), torch.zeros(6, 16, 2, 4, dtype=torch.bfloat16)),
        True,
        ValueError,
        "expected (6, 16, 2, 8)",
    ),
    ("two roles in one buffer", _aliased, True, ValueError, "share bytes"),
]


@pytest.mark.parametrize(
    ("case", "make", "share_pools", "error", "fragment"), BAD_ADOPTS, ids=[c[0] for c in BAD_ADOPTS]
)
def test_bad_adopt_changes_nothing(
    case: str, make: Callable[[CacheLayout], Any], share_pools: Any, error: type, fragment: str
) -> None:
    lay = layout()
    build = builder(lay)
    names = list(build.names)
    with pytest.raises(error) as raised:
        build.adopt(make(lay), share_pools=share_pools)
    assert fragment in str(raised.value)
    assert build.names == names and build.layout is lay  # the builder keeps nothing
    storage = CacheStorage(lay, "cpu")
    with pytest.raises(error) as again:
        storage.adopt(make(lay), max_num_seqs=2, max_model_len=64, share_pools=share_pools)
    assert str(again.value) == str(raised.value)
    assert not storage.ready and storage.device_bytes == 0 and storage.streams is None
    assert storage.adopt(_engine(lay), 2, 64) == BLOCKS  # still retryable
    assert storage.ready


def test_swap_executor_without_copies_on_cpu() -> None:
    lay = layout()
    storage = CacheStorage(lay, "cpu")
    executor = SwapExecutor(lay, storage.platform)
    assert executor.streams is None and executor.in_flight == []
    assert executor.finish() is None
    assert executor.end_copies([torch.zeros(1)]) is None and executor.in_flight == []
    executor.synchronize()
    executor.close()
    assert executor.caches == [] and executor.planes == {} and executor.tables == {}
    with pytest.raises(TypeError, match="plan must be a SwapPlan, got dict"):
        executor.execute({}, None)  # type: ignore[arg-type]
    plan = SwapPlan(plan_id=1, direction="out", requests=(), groups=())
    with pytest.raises(RuntimeError, match="initialize_host_cache"):
        executor.execute(plan, None)
    with pytest.raises(RuntimeError, match="initialize_host_cache"):
        require_host(None)
