"""CacheController: ordering, naming, lookups, memory budgets, lifecycle and bad input."""

import random

import pytest

from kvforge import (
    CacheController,
    ControllerClosedError,
    DSABackend,
    GQABackend,
    MLABackend,
)
from kvforge.attn_backends.base import DeclaredBackend
from kvforge.specs import CacheGroup, CacheRole


def hybrid_backends():
    gqa = GQABackend(4, 64, 16, "bfloat16")
    fp8 = GQABackend(4, 64, 16, "bfloat16", kv_cache_quant="block_wise_fp8")
    return {0: gqa, 1: fp8, 2: gqa, 3: fp8}


def test_order_is_layer_major_in_declared_role_order():
    ctl = CacheController(hybrid_backends())
    ctl.initialize_kv_cache(num_blocks=4)
    assert ctl.storage_names == [
        "key_caches_0_rank0.device0",
        "value_caches_0_rank0.device0",
        "key_caches_1_rank0.device0",
        "value_caches_1_rank0.device0",
        "key_cache_scales_1_rank0.device0",
        "value_cache_scales_1_rank0.device0",
        "key_caches_2_rank0.device0",
        "value_caches_2_rank0.device0",
        "key_caches_3_rank0.device0",
        "value_caches_3_rank0.device0",
        "key_cache_scales_3_rank0.device0",
        "value_cache_scales_3_rank0.device0",
    ]
    assert ctl.index_of("key", 2) == 6
    assert ctl.index_of("value_scale", 3) == 11
    for i, name in enumerate(ctl.storage_names):
        assert ctl.kv_caches[i] is ctl.cache_map[name]
    assert ctl.get("value", 2) is ctl.kv_caches[ctl.index_of("value", 2)]


def test_order_does_not_depend_on_mapping_order():
    backends = hybrid_backends()
    reference = CacheController(backends)
    items = list(backends.items())
    for seed in range(5):
        random.Random(seed).shuffle(items)
        ctl = CacheController(dict(items))
        assert ctl.storage_names == reference.storage_names
        assert ctl.groups == reference.groups
        assert [ctl.index_of("key", layer) for layer in range(4)] == [0, 2, 6, 8]


def test_hybrid_mla_and_dsa_layers_share_a_group():
    ctl = CacheController({0: MLABackend(block_size=64), 1: DSABackend(block_size=64)})
    ctl.initialize_kv_cache(num_blocks=2)
    assert ctl.groups == ["kv"]
    assert ctl.storage_names == [
        "key_caches_0_rank0.device0",
        "key_caches_1_rank0.device0",
        "indexer_caches_1_rank0.device0",
    ]
    # bf16 MLA 1152 B + fp8 DSA 656 + 132 B, 64 tokens per block
    assert ctl.bytes_per_block("kv") == 64 * (1152 + 656 + 132)


def test_conflicting_group_specs_fail_at_construction():
    with pytest.raises(
        ValueError, match=r"group 'kv' is declared differently by layer 0 .* layer 1"
    ):
        CacheController({0: GQABackend(8, 128, 16), 1: GQABackend(8, 128, 32)})


def test_custom_template_rank_and_device():
    ctl = CacheController(
        {0: MLABackend()}, rank=3, device_id=5, name_template="{role}.L{layer}.r{rank}.d{device}"
    )
    assert ctl.storage_name("key", 0) == "key.L0.r3.d5"
    assert ctl.storage.namer.pattern("key") == "key.L{layer}.r3.d5"
    ctl2 = CacheController({0: MLABackend()}, rank=2)
    assert ctl2.storage_name("key", 0) == "key_caches_0_rank2.device0"


@pytest.mark.parametrize(
    ("template", "message"),
    [
        ("{role}_{layer}_{stage}", r"unknown fields \['stage'\]"),
        ("{role}_rank{rank}", r"must contain \{role\} and \{layer\}"),
    ],
)
def test_bad_template(template, message):
    with pytest.raises(ValueError, match=message):
        CacheController({0: MLABackend()}, name_template=template)


def test_memory_budget_sizes_largest_pool():
    backends = {i: GQABackend(8, 128, 16) for i in range(2)}
    ctl = CacheController(backends)
    per_block = 2 * 2 * 16 * 8 * 128 * 2  # layers * (k, v) * tokens * heads * dim * bf16
    assert ctl.bytes_per_block("kv") == per_block == 131_072
    plan = ctl.initialize_kv_cache(memory_budget=10 * per_block + 100)
    assert plan.num_blocks == {"kv": 10}
    assert plan.groups[0].max_tokens == 9 * 16  # block 0 is the reserved null block
    assert ctl.get("key", 0).shape[0] == 10
    assert ctl.device_bytes == 10 * per_block


def test_budget_split_in_proportion_to_bytes_per_token():
    # group a: 16-token blocks of 2 KiB; group b: 64-token blocks of 2 KiB (4x cheaper per token)
    class TwoGroups(DeclaredBackend):
        def __init__(self):
            self.declare(
                [CacheGroup(name="a", block_size=16), CacheGroup(name="b", block_size=64)],
                [
                    CacheRole(name="x", group="a", entry_shape=(128,), dtype="uint8"),
                    CacheRole(name="y", group="b", entry_shape=(32,), dtype="uint8"),
                ],
            )

    ctl = CacheController({0: TwoGroups()})
    plan = ctl.plan_memory(memory_budget=1_000_000)
    blocks = plan.num_blocks
    tokens = plan.max_tokens
    assert blocks == {"a": -(-tokens // 16) + 1, "b": -(-tokens // 64) + 1}
    assert plan.total_bytes <= 1_000_000
    # one more token would not fit
    over = (-(-(tokens + 1) // 16) + 1) * 2048 + (-(-(tokens + 1) // 64) + 1) * 2048
    assert over > 1_000_000


def test_budget_too_small_says_what_one_block_needs():
    ctl = CacheController({0: GQABackend(8, 128, 16)})
    # one block: 2 * 16 * 8 * 128 * 2 = 65,536 bytes; two needed with the null block
    with pytest.raises(
        ValueError,
        match=r"memory_budget=100,000 bytes is too small .* needs 131,072 bytes \(kv: 65,536 B per block\)",
    ):
        ctl.initialize_kv_cache(memory_budget=100_000)
    assert ctl.device_bytes == 0


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({}, "give exactly one of num_blocks or memory_budget"),
        ({"num_blocks": 4, "memory_budget": 10}, "give exactly one of num_blocks or memory_budget"),
        ({"num_blocks": 1}, r"num_blocks\['kv'\] must be an int >= 2 .* got 1"),
        ({"num_blocks": {"kv": 4, "swa": 2}}, r"unknown \['swa'\], missing \[\]"),
        ({"num_blocks": {}}, r"missing \['kv'\]"),
        ({"memory_budget": -5}, "memory_budget must be a positive int, got -5"),
        ({"memory_budget": 1.5e9}, "memory_budget must be an int, got 1500000000.0"),
    ],
)
def test_initialize_bad_input(kwargs, message):
    ctl = CacheController({0: GQABackend(8, 128, 16)})
    with pytest.raises((ValueError, TypeError), match=message):
        ctl.initialize_kv_cache(**kwargs)
    assert ctl.device_bytes == 0


@pytest.mark.parametrize(
    ("backends", "error", "message"),
    [
        ({}, ValueError, "backends is empty"),
        ([GQABackend(8, 128, 16)], TypeError, "backends must be a mapping"),
        ({-1: GQABackend(8, 128, 16)}, ValueError, "layer id -1"),
        ({"0": GQABackend(8, 128, 16)}, ValueError, "layer id '0'"),
        ({0: "gqa"}, TypeError, r"backends\[0\] is a str, not an AttentionBackend"),
    ],
)
def test_bad_backends_mapping(backends, error, message):
    with pytest.raises(error, match=message):
        CacheController(backends)


def test_bad_backend_declarations():
    class Dup(DeclaredBackend):
        def __init__(self):
            group = CacheGroup(name="kv", block_size=16)
            role = CacheRole(name="key", group="kv", entry_shape=(4,), dtype="uint8")
            self.declare([group], [role, role])

    class Orphan(DeclaredBackend):
        def __init__(self):
            role = CacheRole(name="key", group="nowhere", entry_shape=(4,), dtype="uint8")
            self.declare([CacheGroup(name="kv", block_size=16)], [role])

    with pytest.raises(ValueError, match="declares role 'key' twice"):
        Dup()
    with pytest.raises(
        ValueError, match=r"names group 'nowhere', which is not declared \(declared: \['kv'\]\)"
    ):
        Orphan()


def test_unknown_lookups():
    ctl = CacheController({0: GQABackend(8, 128, 16)})
    ctl.initialize_kv_cache(num_blocks=2)
    with pytest.raises(
        KeyError, match=r"layer 0 has no role 'indexer'; its roles are \['key', 'value'\]"
    ):
        ctl.index_of("indexer", 0)
    with pytest.raises(KeyError, match=r"layer 7 has no caches; layers are \[0\]"):
        ctl.storage_name("key", 7)


def test_use_before_initialize_is_clear():
    ctl = CacheController({0: GQABackend(8, 128, 16)})
    with pytest.raises(RuntimeError, match="call initialize_kv_cache before using the caches"):
        _ = ctl.kv_caches


def test_free_is_idempotent_and_closes():
    ctl = CacheController({0: GQABackend(8, 128, 16)})
    ctl.initialize_kv_cache(num_blocks=3)
    assert ctl.device_bytes == 3 * 2 * 16 * 8 * 128 * 2
    ctl.free()
    ctl.free()
    assert ctl.closed and ctl.device_bytes == 0
    with pytest.raises(ControllerClosedError, match="this CacheController was freed"):
        _ = ctl.kv_caches
    with pytest.raises(ControllerClosedError):
        ctl.allocate("r", 4)
    with pytest.raises(ControllerClosedError):
        ctl.initialize_kv_cache(num_blocks=3)


def test_initialize_twice_is_an_error():
    ctl = CacheController({0: GQABackend(8, 128, 16)})
    ctl.initialize_kv_cache(num_blocks=3)
    with pytest.raises(RuntimeError, match="initialize_kv_cache was already called"):
        ctl.initialize_kv_cache(num_blocks=3)


def test_bad_device():
    with pytest.raises(ValueError, match="device 'tpu' is not a device"):
        CacheController({0: GQABackend(8, 128, 16)}, device="tpu")


def test_create_kv_cache_override_is_checked():
    class Wrong(GQABackend):
        def create_kv_cache(self, layer_ids, num_blocks, device):
            caches = super().create_kv_cache(layer_ids, num_blocks, device)
            caches[("key", 0)] = caches[("key", 0)][:, :8]
            return caches

    ctl = CacheController({0: Wrong(8, 128, 16)})
    with pytest.raises(
        ValueError, match=r"gave \('key', 0\) shape \(3, 8, 8, 128\) .* expected \(3, 16, 8, 128\)"
    ):
        ctl.initialize_kv_cache(num_blocks=3)


@pytest.mark.parametrize(
    ("device", "message"),
    [
        ("npu", "device 'npu' requested but torch_npu is not installed or sees no NPU"),
        ("npu:1", "device 'npu:1' requested but torch_npu is not installed"),
    ],
)
def test_npu_without_torch_npu_is_a_clear_error(device, message):
    pytest.importorskip("torch")
    try:
        import torch_npu  # noqa: F401
    except ImportError:
        pass
    else:  # pragma: no cover - an NPU machine
        pytest.skip("torch_npu is installed")
    with pytest.raises(ValueError, match=message):
        CacheController({0: GQABackend(8, 128, 16)}, device=device)
