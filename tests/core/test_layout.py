"""CacheLayout byte figures: device strides with alignment padding, host pages without it,
exact per-token bytes per group kind."""

from fractions import Fraction

import pytest

from kvforge import DeepseekV4Backend, GQABackend
from kvforge.attn_backends import DeclaredBackend
from kvforge.core.layout import CacheLayout
from kvforge.models import from_hf_config
from kvforge.specs import CacheGroup, CacheRole, GroupKind


class Aligned(DeclaredBackend):
    """Another backend's declaration with every role's device block stride aligned."""

    def __init__(self, base: DeclaredBackend, alignment: int) -> None:
        self.base = base
        roles = [
            CacheRole(**(r.model_dump() | {"block_alignment": alignment}))
            for r in base.cache_roles()
        ]
        self.declare(base.cache_groups(), roles)

    def __repr__(self) -> str:
        return f"Aligned({self.base!r})"


def v4_aligned() -> dict[int, DeclaredBackend]:
    kinds = {r: Aligned(DeepseekV4Backend(r), 576) for r in (0, 4, 128)}
    return {layer: kinds[r] for layer, r in enumerate([0, 4, 128])}


# (role, layer) -> (meaningful block bytes, device stride) for DeepSeek-V4 fp8, alignment 576
V4_BLOCKS = {
    ("swa_kv", 0): (64 * 584, 65 * 576),  # 37,376 -> 37,440
    ("swa_kv", 1): (64 * 584, 65 * 576),
    ("compressed_kv", 1): (256 // 4 * 584, 65 * 576),  # 37,376 -> 37,440
    ("indexer", 1): (256 // 4 * 132, 15 * 576),  # 8,448 -> 8,640
    ("compressor_state", 1): (4 * 2 * 2 * 512 * 4, 57 * 576),  # 32,768 -> 32,832
    ("indexer_compressor_state", 1): (4 * 2 * 2 * 128 * 4, 15 * 576),  # 8,192 -> 8,640
    ("swa_kv", 2): (64 * 584, 65 * 576),
    ("compressed_kv", 2): (256 // 128 * 584, 3 * 576),  # 1,168 -> 1,728
    ("compressor_state", 2): (8 * 2 * 512 * 4, 57 * 576),  # 32,768 -> 32,832
}


def test_deepseek_v4_aligned_strides_per_layer_and_block():
    layout = CacheLayout(v4_aligned())
    got = {e.key: (e.block_bytes, e.device_block_bytes) for e in layout.buffers}
    assert got == V4_BLOCKS
    assert {k: v[1] for k, v in got.items()} == {
        ("swa_kv", 0): 37_440,
        ("swa_kv", 1): 37_440,
        ("compressed_kv", 1): 37_440,
        ("indexer", 1): 8_640,
        ("compressor_state", 1): 32_832,
        ("indexer_compressor_state", 1): 8_640,
        ("swa_kv", 2): 37_440,
        ("compressed_kv", 2): 1_728,
        ("compressor_state", 2): 32_832,
    }
    assert {k: v[0] for k, v in got.items()} == {
        ("swa_kv", 0): 37_376,
        ("swa_kv", 1): 37_376,
        ("compressed_kv", 1): 37_376,
        ("indexer", 1): 8_448,
        ("compressor_state", 1): 32_768,
        ("indexer_compressor_state", 1): 8_192,
        ("swa_kv", 2): 37_376,
        ("compressed_kv", 2): 1_168,
        ("compressor_state", 2): 32_768,
    }


def test_group_bytes_device_padded_host_packed():
    layout = CacheLayout(v4_aligned())
    device = {g.name: layout.bytes_per_block(g.name) for g in layout.groups}
    host = {g.name: layout.host_page_bytes(g.name) for g in layout.groups}
    assert device == {
        "swa": 3 * 37_440,
        "compressed": 37_440 + 8_640 + 1_728,
        "c4_state": 32_832 + 8_640,
        "c128_state": 32_832,
    }
    assert host == {
        "swa": 3 * 37_376,
        "compressed": 37_376 + 8_448 + 1_168,
        "c4_state": 32_768 + 8_192,
        "c128_state": 32_768,
    }


def test_exact_bytes_per_token_by_kind():
    layout = CacheLayout(v4_aligned())
    by_kind = layout.bytes_per_token_by_kind()
    assert by_kind == {
        GroupKind.SLIDING_WINDOW: Fraction(3 * 37_440, 64),  # 1,755
        GroupKind.FULL: Fraction(37_440 + 8_640 + 1_728, 256),  # 47,808 / 256 = 186.75
        GroupKind.STATE: Fraction(32_832 + 8_640, 4) + Fraction(32_832, 8),  # 10,368 + 4,104
    }
    assert all(isinstance(v, Fraction) for v in by_kind.values())
    assert layout.kv_bytes_per_token() == Fraction(747, 4)
    assert layout.bytes_per_request() == 0


def test_kv_bytes_per_token_is_an_int_when_whole():
    layout = CacheLayout({i: GQABackend(8, 128, 16) for i in range(32)})
    per_token = layout.kv_bytes_per_token()
    assert per_token == 2 * 32 * 8 * 128 * 2 == 131_072
    assert type(per_token) is int


def test_every_layer_slides_is_not_zero():
    # Mistral-7B-v0.1: 32 layers, all sliding window 4096, 8 kv heads of 128, bf16
    layout = CacheLayout(from_hf_config("mistral-7b-v0.1"))
    assert [g.kind for g in layout.groups] == [GroupKind.SLIDING_WINDOW]
    assert layout.bytes_per_token_by_kind() == {GroupKind.SLIDING_WINDOW: Fraction(131_072)}
    assert layout.kv_bytes_per_token() == 2 * 32 * 8 * 128 * 2 == 131_072


def test_per_request_bytes():
    class Hybrid(DeclaredBackend):
        def __init__(self) -> None:
            self.declare(
                [
                    CacheGroup(name="kv", block_size=16),
                    CacheGroup(name="ssm", block_size=1, kind="per_request", slots_per_request=2),
                    CacheGroup(name="chunk", block_size=16, kind="chunked", window=8192),
                ],
                [
                    CacheRole(name="key", group="kv", entry_shape=(2, 64), dtype="bfloat16"),
                    CacheRole(name="conv", group="ssm", entry_shape=(3, 1024), dtype="bfloat16"),
                    CacheRole(name="ck", group="chunk", entry_shape=(2, 64), dtype="bfloat16"),
                ],
            )

    layout = CacheLayout({0: Hybrid(), 1: Hybrid()})
    assert layout.bytes_per_request() == 2 * 2 * (3 * 1024 * 2)  # layers * slots * state
    assert layout.bytes_per_token_by_kind() == {
        GroupKind.FULL: Fraction(2 * 2 * 64 * 2),
        GroupKind.CHUNKED: Fraction(2 * 2 * 64 * 2),
    }


def test_max_model_len_from_argument_or_mapping():
    backends = {0: GQABackend(2, 8, 16)}
    assert CacheLayout(backends).max_model_len is None
    assert CacheLayout(backends, max_model_len=4096).max_model_len == 4096

    class WithLength(dict):
        max_model_len = 8192

    assert CacheLayout(WithLength(backends)).max_model_len == 8192
    assert CacheLayout(WithLength(backends), max_model_len=100).max_model_len == 100


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (0, "max_model_len must be a positive number of tokens, got 0"),
        (4096.0, r"max_model_len must be an int, got 4096.0 \(float\)"),
        (True, r"max_model_len must be an int, got True \(bool\)"),
    ],
)
def test_bad_max_model_len(value, message):
    with pytest.raises(ValueError, match=message):
        CacheLayout({0: GQABackend(2, 8, 16)}, max_model_len=value)


def test_compress_ratios_per_group() -> None:
    layout = CacheLayout(from_hf_config("deepseek-v4-flash"))
    assert {g.name: layout.compress_ratios(g.name) for g in layout.groups} == {
        "swa": (1,),
        "compressed": (4, 128),
        "c4_state": (1,),
        "c128_state": (1,),
    }
    with pytest.raises(ValueError, match="group 'nope' does not exist"):
        layout.compress_ratios("nope")


POOL_REFUSALS = [
    # (share_pools, num_blocks, exception, message)
    ("yes", {"swa": 4, "kv": 4}, TypeError, "share_pools must be a bool, got 'yes'"),
    (
        True,
        {"swa": 4, "kv": 5},
        ValueError,
        "num_blocks gives {'swa': 4, 'kv': 5} to groups ['swa', 'kv'], which share one pool",
    ),
]


def test_pools_are_the_pool_sets_with_sharing_else_every_group_alone() -> None:
    layout = CacheLayout({0: GQABackend(1, 8, 16, sliding_window=32), 1: GQABackend(1, 8, 16)})
    assert layout.pools(True, {"swa": 4, "kv": 4}) == (("swa", "kv"),)
    # without sharing the counts may differ
    assert layout.pools(False, {"swa": 4, "kv": 5}) == (("swa",), ("kv",))


@pytest.mark.parametrize(("share", "blocks", "exc", "message"), POOL_REFUSALS)
def test_pools_refuse(share: object, blocks: dict[str, int], exc: type, message: str) -> None:
    layout = CacheLayout({0: GQABackend(1, 8, 16, sliding_window=32), 1: GQABackend(1, 8, 16)})
    with pytest.raises(exc) as info:
        layout.pools(share, blocks)  # type: ignore[arg-type]
    assert message in str(info.value)
