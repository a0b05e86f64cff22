"""CacheGroup / CacheRole validation and derived integer byte counts."""

from fractions import Fraction

import pytest
import torch
from pydantic import ValidationError

from kvforge import CacheGroup, CacheRole, GroupKind
from kvforge.specs import DTYPE_ITEMSIZE, GroupFamily, canonical_dtype, check_role_in_group


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


# ---------------------------------------------------------------------------- strict values


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"block_size": "16"}, r"block_size must be an int, got '16' \(str\)"),
        ({"block_size": 16.0}, r"block_size must be an int, got 16.0 \(float\)"),
        ({"block_size": True}, r"block_size must be an int, got True \(bool\)"),
        (
            {"block_size": 16, "kind": "sliding_window", "window": "128"},
            "window must be an int, got '128' \\(str\\) on group 'g'",
        ),
        (
            {"block_size": 16, "kind": "chunked", "window": 8192.0},
            r"window must be an int, got 8192.0 \(float\) on group 'g'",
        ),
        (
            {"block_size": 16, "kind": "state", "window": -8},
            "window must be a positive number of tokens, got -8 on group 'g'",
        ),
        ({"block_size": 16, "kind": "chunked"}, "window is required for a chunked group"),
        (
            {"block_size": 1, "kind": "per_request", "window": 4},
            "window must be None for a per_request group, got window=4 on group 'g'",
        ),
        (
            {"block_size": 16, "kind": "per_request"},
            "block_size must be 1 for a per_request group .* got block_size=16 on group 'g'",
        ),
        (
            {"block_size": 16, "slots_per_request": 2},
            "slots_per_request=2 is only for per_request groups; group 'g' is full",
        ),
        (
            {"block_size": 64, "kind": "sliding_window", "window": 128, "slots_per_request": 3},
            "slots_per_request=3 is only for per_request groups; group 'g' is sliding_window",
        ),
        (
            {"block_size": 1, "kind": "per_request", "slots_per_request": 0},
            "slots_per_request must be a positive number of slots, got 0",
        ),
        (
            {"block_size": 1, "kind": "per_request", "slots_per_request": True},
            r"slots_per_request must be an int, got True \(bool\)",
        ),
    ],
)
def test_group_strict_values_name_field_and_value(kwargs, message):
    with pytest.raises(ValueError, match=message):
        CacheGroup(name="g", **kwargs)


ROLE = {"name": "key", "group": "kv", "entry_shape": (8, 128), "dtype": "bfloat16"}


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"compress_ratio": "2"}, "compress_ratio must be an int, got '2' \\(str\\)"),
        ({"compress_ratio": True}, r"compress_ratio must be an int, got True \(bool\)"),
        ({"compress_ratio": 2.0}, r"compress_ratio must be an int, got 2.0 \(float\)"),
        ({"compress_ratio": -4}, "compress_ratio must be >= 1, got -4"),
        ({"block_alignment": 0}, "block_alignment must be a positive number of bytes, got 0"),
        ({"block_alignment": 576.0}, r"block_alignment must be an int, got 576.0 \(float\)"),
        ({"block_alignment": False}, r"block_alignment must be an int, got False \(bool\)"),
        ({"block_layout": "HND"}, "block_layout must be one of .*, got 'HND'"),
        (
            {"block_layout": "head_major", "entry_shape": (576,)},
            r"block_layout='head_major' needs an entry_shape of at least 2 dimensions "
            r"\(heads first\), got entry_shape=\(576,\) on role 'key'",
        ),
        ({"offload": 1}, r"offload must be a bool, got 1 \(int\)"),
        ({"entry_shape": (8, True)}, r"entry_shape\[1\] must be a positive int, got True"),
        ({"entry_shape": (8, 2.0)}, r"entry_shape\[1\] must be a positive int, got 2.0"),
        ({"entry_shape": "8"}, "entry_shape must be a tuple of ints, got '8'"),
    ],
)
def test_role_strict_values_name_field_and_value(kwargs, message):
    with pytest.raises(ValueError, match=message):
        CacheRole(**(ROLE | kwargs))


# ---------------------------------------------------------------------------- kinds


def test_family_per_kind():
    groups = {
        "full": CacheGroup(name="a", block_size=16),
        "sliding_window": CacheGroup(name="b", block_size=16, kind="sliding_window", window=64),
        "state": CacheGroup(name="c", block_size=4, kind="state", window=8),
        "chunked": CacheGroup(name="d", block_size=16, kind="chunked", window=8192),
        "per_request": CacheGroup(name="e", block_size=1, kind="per_request"),
    }
    assert {k: g.family for k, g in groups.items()} == {
        "full": "history",
        "sliding_window": "window",
        "state": "window",
        "chunked": "window",
        "per_request": "snapshot",
    }
    assert GroupFamily.HISTORY == "history"
    assert {k: g.windowed for k, g in groups.items()} == {
        "full": False,
        "sliding_window": True,
        "state": True,
        "chunked": True,
        "per_request": False,
    }


def _range(group, n):
    r = group.live_token_range(n)
    return (r.start, r.end)


def test_chunked_window_restarts_at_every_chunk():
    # chunk of 10 tokens in 4-token blocks: chunks start at 0, 10, 20, ... (offsets 0, 2, 0, 2)
    g = CacheGroup(name="chunk", block_size=4, kind=GroupKind.CHUNKED, window=10)
    assert _range(g, 0) == (0, 0)
    assert _range(g, 1) == (0, 1)
    assert _range(g, 10) == (0, 10)  # token 9 ends chunk 0 and reads all of it
    assert _range(g, 11) == (10, 11)  # token 10 starts chunk 1
    assert _range(g, 20) == (10, 20)
    assert _range(g, 25) == (20, 25)
    assert g.blocks_for(25) == 7  # cdiv(25, 4)
    assert g.first_live_block(25) == 20 // 4 == 5
    assert g.first_live_block(20) == 10 // 4 == 2  # tokens 10..19 sit in blocks 2, 3, 4
    # worst case: chunk 1 = tokens 10..19 starts at offset 2 of block 2 and ends in block 4:
    # cdiv(W + B - gcd(W, B), B) = cdiv(10 + 4 - 2, 4) = 3
    assert g.max_live_blocks(10_000) == 3
    worst = max(g.blocks_for(n) - g.first_live_block(n) for n in range(1, 200))
    assert worst == 3
    assert g.max_live_blocks(5) == 2  # a 5-token sequence never holds more than cdiv(5, 4)


def test_chunked_block_size_divides_window_holds_one_chunk():
    # Llama-4: chunk 8192, block 16 -> 512 blocks, never 513
    g = CacheGroup(name="chunk", block_size=16, kind="chunked", window=8192)
    assert g.max_live_blocks(1 << 20) == 8192 // 16 == 512
    assert max(g.blocks_for(n) - g.first_live_block(n) for n in range(1, 3 * 8192, 7)) == 512


def test_sliding_window_bound_is_reached():
    g = CacheGroup(name="swa", block_size=64, kind="sliding_window", window=128)
    # (128 + 62) // 64 + 1 = 3: tokens 1..128 span blocks 0, 1 and 2
    assert g.max_live_blocks(1 << 20) == 3
    assert max(g.blocks_for(n) - g.first_live_block(n) for n in range(1, 1000)) == 3


def test_per_request_group_holds_its_slots_whatever_the_length():
    g = CacheGroup(name="ssm", block_size=1, kind=GroupKind.PER_REQUEST, slots_per_request=2)
    assert g.blocks_for(0) == 0  # no tokens, no request
    assert g.blocks_for(1) == 2
    assert g.blocks_for(1_000_000) == 2
    assert g.max_live_blocks(65536) == 2
    assert g.first_live_block(5000) == 0
    assert _range(g, 5000) == (0, 5000)
    state = CacheRole(name="conv", group="ssm", entry_shape=(3, 8192), dtype="bfloat16")
    assert state.entries_per_block(g) == 1
    assert state.block_bytes(g) == 3 * 8192 * 2 == 49_152
    compressed = CacheRole(name="c", group="ssm", entry_shape=(4,), dtype="uint8", compress_ratio=2)
    with pytest.raises(
        ValueError, match="compress_ratio=2 of role 'c' is not allowed in per_request group 'ssm'"
    ):
        check_role_in_group(compressed, g)


@pytest.mark.parametrize("bad", [-1, 2.0, "3", True, None])
def test_token_counts_are_checked(bad):
    g = CacheGroup(name="kv", block_size=16)
    for method in (g.live_token_range, g.blocks_for, g.max_live_blocks, g.first_live_block):
        with pytest.raises(ValueError, match=f"num_tokens must be an int >= 0, got {bad!r}"):
            method(bad)


def test_numpy_token_counts_are_accepted():
    np = pytest.importorskip("numpy")
    g = CacheGroup(name="swa", block_size=16, kind="sliding_window", window=32)
    assert g.blocks_for(np.int64(33)) == 3
    assert _range(g, np.int32(40)) == (8, 40)


# ---------------------------------------------------------------------------- bytes and layouts


def test_alignment_pads_the_device_stride_only():
    # DeepSeek-V4 fp8 swa_kv: 64 tokens x 584 B = 37,376 B -> 65 * 576 = 37,440 B on device
    swa = CacheGroup(name="swa", block_size=64, kind="sliding_window", window=128)
    role = CacheRole(
        name="swa_kv", group="swa", entry_shape=(584,), dtype="uint8", block_alignment=576
    )
    assert role.block_bytes(swa) == 64 * 584 == 37_376
    assert role.device_block_bytes(swa) == 65 * 576 == 37_440
    assert role.device_bytes_per_token(swa) == Fraction(37_440, 64) == 585
    unaligned = role.model_copy(update={"block_alignment": 1})
    assert unaligned.device_block_bytes(swa) == 37_376


def test_alignment_must_keep_whole_elements():
    g = CacheGroup(name="st", block_size=4, kind="state", window=8)
    role = CacheRole(name="s", group="st", entry_shape=(3,), dtype="float32", block_alignment=10)
    # 4 * 3 * 4 = 48 B -> 50 B: not a whole number of 4-byte floats
    with pytest.raises(
        ValueError,
        match=r"block_alignment=10 of role 's' gives a device block stride of 50 bytes, "
        r"not a whole number of float32 elements \(4 bytes each\)",
    ):
        role.device_block_bytes(g)


def test_fractional_bytes_per_token_are_exact():
    c128 = CacheRole(
        name="compressed_kv",
        group="compressed",
        entry_shape=(584,),
        dtype="uint8",
        compress_ratio=128,
        block_alignment=576,
    )
    group = CacheGroup(name="compressed", block_size=256)
    assert c128.bytes_per_token == Fraction(584, 128) == Fraction(73, 16)
    assert isinstance(c128.bytes_per_token, Fraction)
    # two 584 B entries per 256-token block: 1,168 B -> 1,728 B (3 * 576) on device
    assert c128.device_block_bytes(group) == 1_728
    assert c128.device_bytes_per_token(group) == Fraction(1_728, 256) == Fraction(27, 4)


@pytest.mark.parametrize(
    ("layout", "shape"),
    [("token_major", (16, 8, 128)), ("head_major", (8, 16, 128))],
)
def test_block_shape_per_layout(layout, shape):
    group = CacheGroup(name="kv", block_size=16)
    role = CacheRole(**(ROLE | {"block_layout": layout}))
    assert role.block_shape(group) == shape
    assert role.block_bytes(group) == 16 * 8 * 128 * 2 == 32_768


def test_head_major_with_more_dims_keeps_the_tail():
    group = CacheGroup(name="kv", block_size=64)
    role = CacheRole(
        name="k", group="kv", entry_shape=(4, 2, 64), dtype="float16", block_layout="head_major"
    )
    assert role.block_shape(group) == (4, 64, 2, 64)
