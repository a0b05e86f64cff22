"""GQABackend with key and value heads of different widths (``head_dim_v``): roles, bytes per
token, quantised variants, errors. Arithmetic beside every figure; bf16 is 2 bytes."""

from __future__ import annotations

import pytest
import torch

from kvforge._checks import ArgumentError
from kvforge.attn_backends import GQABackend
from kvforge.core.layout import CacheLayout


def _roles(b: GQABackend) -> dict[str, tuple[tuple[int, ...], str]]:
    return {r.name: (r.entry_shape, r.dtype) for r in b.cache_roles()}


@pytest.mark.parametrize(
    ("kwargs", "roles", "per_token"),
    [
        # MiMo-V2-Flash full layer: 4 heads * (192 + 128) * 2 B
        (
            dict(num_kv_heads=4, head_dim=192, head_dim_v=128),
            {"key": ((4, 192), "bfloat16"), "value": ((4, 128), "bfloat16")},
            4 * (192 + 128) * 2,
        ),
        # default: the value is as wide as the key, 2 * 8 * 128 * 2 B
        (
            dict(num_kv_heads=8, head_dim=128),
            {"key": ((8, 128), "bfloat16"), "value": ((8, 128), "bfloat16")},
            2 * 8 * 128 * 2,
        ),
        # head_dim_v equal to head_dim is the same declaration
        (
            dict(num_kv_heads=8, head_dim=128, head_dim_v=128),
            {"key": ((8, 128), "bfloat16"), "value": ((8, 128), "bfloat16")},
            2 * 8 * 128 * 2,
        ),
        # fp8: 8 heads * (192 + 128) * 1 B
        (
            dict(num_kv_heads=8, head_dim=192, head_dim_v=128, kv_cache_quant="fp8"),
            {"key": ((8, 192), "float8_e4m3fn"), "value": ((8, 128), "float8_e4m3fn")},
            8 * 320,
        ),
        # block-wise fp8: 8 * 320 * 1 B + 2 scales * 8 heads * 4 B
        (
            dict(num_kv_heads=8, head_dim=192, head_dim_v=128, kv_cache_quant="block_wise_fp8"),
            {
                "key": ((8, 192), "float8_e4m3fn"),
                "value": ((8, 128), "float8_e4m3fn"),
                "key_scale": ((8,), "float32"),
                "value_scale": ((8,), "float32"),
            },
            8 * 320 + 2 * 8 * 4,
        ),
    ],
)
def test_value_width(kwargs, roles, per_token):
    b = GQABackend(block_size=16, **kwargs)
    assert _roles(b) == roles
    assert CacheLayout({0: b}).kv_bytes_per_token() == per_token


def test_head_major_and_window_keep_the_widths():
    b = GQABackend(8, 192, 16, head_dim_v=128, block_layout="head_major", sliding_window=128)
    group = b.cache_groups()[0]
    key, value = b.cache_roles()
    # head-major blocks: [heads, block, width]
    assert key.block_shape(group) == (8, 16, 192) and value.block_shape(group) == (8, 16, 128)
    assert (group.name, group.window) == ("swa", 128)


def test_buffers_have_the_value_width():
    b = GQABackend(2, 64, 16, head_dim_v=32)
    caches = b.create_kv_cache([0], {"kv": 3}, "cpu")
    assert tuple(caches[("key", 0)].shape) == (3, 16, 2, 64)
    assert tuple(caches[("value", 0)].shape) == (3, 16, 2, 32)
    assert caches[("value", 0)].dtype == torch.bfloat16


def test_repr_names_a_different_value_width():
    assert "head_dim_v=128" in repr(GQABackend(4, 192, head_dim_v=128))
    assert "head_dim_v" not in repr(GQABackend(4, 192, head_dim_v=192))


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (0, "GQABackend: head_dim_v must be a positive int, got 0"),
        (-128, "GQABackend: head_dim_v must be a positive int, got -128"),
        (True, "GQABackend: head_dim_v must be an int, got True"),
        (128.0, "GQABackend: head_dim_v must be an int, got 128.0"),
        ("128", "GQABackend: head_dim_v must be an int, got '128'"),
    ],
)
def test_bad_head_dim_v(value, message):
    with pytest.raises(ArgumentError) as info:
        GQABackend(4, 192, head_dim_v=value)
    assert message in str(info.value)
