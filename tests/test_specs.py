"""CacheGroup / CacheRole validation and derived integer byte counts."""

import pytest
import torch
from pydantic import ValidationError

from kvforge import CacheGroup, CacheRole, GroupKind
from kvforge.specs import DTYPE_ITEMSIZE, canonical_dtype, check_role_in_group


def test_role_derived_bytes_are_integers():
    group = CacheGroup(name="kv", block_size=16)
    role = CacheRole(name="key", group="kv", entry_shape=(8, 128), dtype=torch.bfloat16)
    assert role.dtype == "bfloat16"
    assert role.entry_bytes == 8 * 128 * 2 == 2048
    assert role.entries_per_block(group) == 16
    assert role.block_bytes(group) == 16 * 2048 == 32768
    assert isinstance(role.block_bytes(group), int)


def test_compressed_role_entries_per_block():
    group = CacheGroup(name="compressed", block_size=256)
    role = CacheRole(
        name="c", group="compressed", entry_shape=584, dtype="uint8", compress_ratio=128
    )
    assert role.entry_shape == (584,)
    assert role.entries_per_block(group) == 256 // 128 == 2
    assert role.block_bytes(group) == 2 * 584 == 1168
    assert role.entries_for(1000) == 1000 // 128 == 7


def test_ratio_that_does_not_divide_block_size_is_value_error():
    group = CacheGroup(name="kv", block_size=64)
    role = CacheRole(name="c", group="kv", entry_shape=(4,), dtype="uint8", compress_ratio=3)
    with pytest.raises(
        ValueError, match=r"compress_ratio=3 of role 'c' does not divide block_size=64"
    ):
        role.entries_per_block(group)
    with pytest.raises(ValueError, match="compress_ratio=3"):
        check_role_in_group(role, group)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"block_size": 0}, "block_size must be a positive number of tokens, got 0"),
        ({"block_size": -4}, "block_size must be a positive number of tokens, got -4"),
        ({"block_size": 16, "window": 8}, "window must be None for a full group, got window=8"),
        ({"block_size": 16, "kind": "sliding_window"}, "window is required for a sliding_window"),
        ({"block_size": 16, "kind": "state"}, "window is required for a state group"),
        ({"block_size": 16, "kind": "sliding_window", "window": 0}, "window must be a positive"),
        ({"block_size": 16, "kind": "ring"}, "kind must be one of"),
    ],
)
def test_group_validation_names_field_and_value(kwargs, message):
    with pytest.raises(ValueError, match=message):
        CacheGroup(name="g", **kwargs)


def test_group_is_strict_about_types():
    with pytest.raises(ValidationError, match="block_size"):
        CacheGroup(name="g", block_size="16")
    with pytest.raises(ValidationError, match="block_size"):
        CacheGroup(name="g", block_size=16.0)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"entry_shape": (8, 0)}, r"entry_shape\[1\] must be a positive int, got 0"),
        ({"entry_shape": (-1,)}, r"entry_shape\[0\] must be a positive int, got -1"),
        ({"entry_shape": ()}, "entry_shape must have at least one dimension"),
        ({"compress_ratio": 0}, "compress_ratio must be >= 1, got 0"),
        ({"dtype": "float64"}, "dtype 'float64' is not supported"),
        ({"dtype": 3}, "dtype must be a torch.dtype or a string, got 3"),
        ({"name": ""}, "name"),
    ],
)
def test_role_validation_names_field_and_value(kwargs, message):
    base = {"name": "key", "group": "kv", "entry_shape": (4,), "dtype": "bfloat16"}
    with pytest.raises(ValueError, match=message):
        CacheRole(**(base | kwargs))


def test_specs_are_frozen():
    group = CacheGroup(name="g", block_size=16)
    with pytest.raises(ValidationError):
        group.block_size = 32


def test_dtype_aliases():
    assert canonical_dtype("bf16") == "bfloat16"
    assert canonical_dtype("fp8") == "float8_e4m3fn"
    assert canonical_dtype(torch.float32) == "float32"
    assert DTYPE_ITEMSIZE["float8_e4m3fn"] == 1


def test_window_ranges_and_live_blocks():
    swa = CacheGroup(name="swa", block_size=64, kind=GroupKind.SLIDING_WINDOW, window=128)
    assert swa.live_token_range(100).start == 0
    assert swa.live_token_range(300).start == 300 - 128
    assert swa.blocks_for(300) == 5
    # tokens 1..128 of a window starting mid-block span blocks 0, 1, 2
    assert swa.max_live_blocks(10_000) == 3
    assert swa.max_live_blocks(64) == 1
    full = CacheGroup(name="kv", block_size=16)
    assert full.max_live_blocks(100) == 7
