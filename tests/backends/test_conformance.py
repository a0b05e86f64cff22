"""kvforge.testing.check_backend: passes every bundled backend, names the check each broken one fails."""

import pytest
import torch

from kvforge import (
    CacheController,
    CacheGroup,
    CacheRole,
    DeepseekV4Backend,
    DSABackend,
    GQABackend,
    MHABackend,
    MLABackend,
    SwapPurpose,
    TokenRange,
)
from kvforge.attn_backends import AttentionBackend, DeclaredBackend
from kvforge.models import from_hf_config
from kvforge.testing import CHECKS, CheckResult, ConformanceError, check_backend

# ---------------------------------------------------------------------- legal backends


class FusedKV(GQABackend):
    """key and value carved from one [2, num_blocks, ...] allocation per layer: legal."""

    def create_kv_cache(self, layer_ids, num_blocks, device):
        key = self.role("key")
        caches = {}
        for layer in layer_ids:
            kv = torch.zeros(
                (2, num_blocks[key.group], *self.block_shape(key)),
                dtype=key.torch_dtype,
                device=device,
            )
            caches[("key", layer)], caches[("value", layer)] = kv[0], kv[1]
        return caches


class Scratch(DeclaredBackend):
    """A role that is never offloaded: nothing is promised for it, so nothing is compared."""

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


class PrefixKeysOnly(GQABackend):
    """Promises only keys for a prefix swap."""

    def offload_selection(self, role, num_tokens, purpose):
        if purpose is SwapPurpose.PREFIX and role.name == "value":
            return TokenRange(start=num_tokens, end=num_tokens)
        return super().offload_selection(role, num_tokens, purpose)


class GQAWithKeyNorm(GQABackend):
    def __init__(self, num_kv_heads, head_dim, block_size=16):
        super().__init__(num_kv_heads, head_dim, block_size)
        norm = CacheRole(name="key_norm", group="kv", entry_shape=(num_kv_heads,), dtype="float32")
        self.declare(self.cache_groups(), [*self.cache_roles(), norm])


LEGAL = {
    "gqa_bf16": lambda: GQABackend(4, 32, 16, "bfloat16"),
    "gqa_fp8": lambda: GQABackend(4, 32, 16, kv_cache_quant="fp8"),
    "gqa_block_wise_fp8": lambda: GQABackend(4, 32, 16, kv_cache_quant="block_wise_fp8"),
    "gqa_sliding_window": lambda: GQABackend(4, 32, 16, sliding_window=40),
    "mha": lambda: MHABackend(4, 32),
    "mla": lambda: MLABackend(block_size=16),
    "dsa_fp8": lambda: DSABackend(block_size=64),
    "dsa_bf16": lambda: DSABackend(block_size=64, kv_cache_dtype="bf16"),
    "dsa_no_indexer": lambda: DSABackend(block_size=64, indexer=False),
    "deepseek_v4_ratio_0": lambda: DeepseekV4Backend(0),
    "deepseek_v4_ratio_4": lambda: DeepseekV4Backend(4),
    "deepseek_v4_ratio_128": lambda: DeepseekV4Backend(128),
    "deepseek_v4_tiny": lambda: from_hf_config("deepseek-v4-tiny"),
    "deepseek_v4_tiny_with_mtp": lambda: from_hf_config(
        "deepseek-v4-tiny", num_speculative_tokens=1
    ),
    "fused_kv_allocation": lambda: FusedKV(2, 16, 8),
    "role_not_offloaded": Scratch,
    "prefix_keys_only": lambda: PrefixKeysOnly(2, 16, 8),
    "mixed_layers": lambda: {
        0: GQABackend(2, 16, 8),
        3: GQAWithKeyNorm(2, 16, 8),
        1: GQABackend(2, 16, 8),
    },
}


@pytest.mark.parametrize("name", sorted(LEGAL))
def test_every_bundled_backend_conforms(name):
    report = check_backend(LEGAL[name]())
    assert report.names == CHECKS
    by_name = {c.name: c for c in report.checks}
    declared = by_name["declaration"].buffers
    assert declared > 0
    # every check covered every buffer; the round trip compared entries of the offloaded ones
    assert [by_name[c].buffers for c in ("bytes", "naming_and_order", "no_overlap")] == [
        declared
    ] * 3
    assert by_name["bytes"].bytes == by_name["no_overlap"].bytes > 0
    assert 0 < by_name["swap_round_trip"].buffers <= declared
    assert by_name["swap_round_trip"].entries > 0 and by_name["swap_round_trip"].bytes > 0


def test_report_numbers_by_hand():
    # GQA, 2 kv heads * 8 dims * bf16 = 32 B per entry, 4-token blocks; one instance on layers 0, 1
    report = check_backend(GQABackend(2, 8, 4), tokens=10)
    assert report.layers == (0, 1)
    assert report.tokens == 10
    assert report.num_blocks == {"kv": 5}  # blocks_for(10) = 3, + a blocker + the null block
    assert report.purposes == (SwapPurpose.PREEMPT, SwapPurpose.PREFIX)
    assert report.checks[0] == CheckResult(
        "declaration", 4, 0, 0, "1 backend(s) over 2 layer(s), 2 role(s), 1 group(s)"
    )
    # 4 buffers * 5 blocks * 4 entries = 80 entries of 32 B
    assert (report.check("bytes").entries, report.check("bytes").bytes) == (80, 2_560)
    assert report.check("no_overlap").bytes == 2_560
    # per purpose: 4 buffers * 10 tokens = 40 entries; two purposes
    swap = report.check("swap_round_trip")
    assert (swap.buffers, swap.entries, swap.bytes) == (4, 80, 80 * 32)
    assert (
        swap.note
        == "10 tokens; preempt: 40 entries, prefix: 40 entries compared byte for byte after swap in"
    )
    with pytest.raises(KeyError, match=r"no check named 'speed' ran; checks: \['declaration', "):
        report.check("speed")


def test_prefix_round_trip_compares_no_state():
    # DeepSeek-V4 ratio 4 on layers 0, 1 with the default 769 tokens (3 * 256 + 1):
    # swa_kv keeps the last 128 tokens; compressed_kv and indexer (r=4) one entry per 4 tokens,
    # 769 // 4 = 192; the two c4_state roles keep the last 8 positions (preempt only).
    report = check_backend(DeepseekV4Backend(4))
    assert report.tokens == 769
    preempt = 2 * (128 + 192 + 192 + 8 + 8)
    prefix = 2 * (128 + 192 + 192)
    assert (preempt, prefix) == (1_056, 1_024)
    assert report.check("swap_round_trip").entries == preempt + prefix
    assert report.check("swap_round_trip").note == (
        "769 tokens; preempt: 1056 entries, prefix: 1024 entries compared byte for byte after swap in"
    )


def test_only_the_purposes_asked_for_run():
    report = check_backend(GQABackend(2, 8, 4), tokens=10, purposes=["prefix"])
    assert report.purposes == (SwapPurpose.PREFIX,)
    assert report.check("swap_round_trip").entries == 40
    none = check_backend(GQABackend(2, 8, 4), tokens=10, purposes=())
    assert none.check("swap_round_trip") == CheckResult(
        "swap_round_trip", 0, 0, 0, "nothing to swap: no purpose was asked for"
    )


def test_backend_with_nothing_offloaded_skips_the_round_trip():
    class NothingOffloaded(DeclaredBackend):
        def __init__(self):
            self.declare(
                [CacheGroup(name="kv", block_size=4)],
                [CacheRole(name="key", group="kv", entry_shape=(8,), dtype="uint8", offload=False)],
            )

    report = check_backend(NothingOffloaded())
    assert report.check("swap_round_trip") == CheckResult(
        "swap_round_trip", 0, 0, 0, "nothing to swap: no role is offloaded"
    )


def test_explicit_num_blocks():
    report = check_backend(GQABackend(2, 8, 4), tokens=10, num_blocks={"kv": 9})
    assert report.num_blocks == {"kv": 9}
    assert report.check("bytes").entries == 4 * 9 * 4


# ---------------------------------------------------------------------- broken backends


class WrongDtype(GQABackend):
    def create_kv_cache(self, layer_ids, num_blocks, device):
        caches = super().create_kv_cache(layer_ids, num_blocks, device)
        caches[("key", 0)] = caches[("key", 0)].to(torch.float16)
        return caches


class WrongBlockBytes(GQABackend):
    def create_kv_cache(self, layer_ids, num_blocks, device):
        caches = super().create_kv_cache(layer_ids, num_blocks, device)
        n, *block = caches[("value", 1)].shape
        caches[("value", 1)] = torch.zeros(
            n, block[0], block[1], 2 * block[2], dtype=torch.bfloat16
        )
        return caches


class WrongBlockCount(GQABackend):
    def create_kv_cache(self, layer_ids, num_blocks, device):
        caches = super().create_kv_cache(layer_ids, num_blocks, device)
        caches[("key", 0)] = caches[("key", 0)][:-1]
        return caches


class WrongShapeRightBytes(GQABackend):
    def create_kv_cache(self, layer_ids, num_blocks, device):
        caches = super().create_kv_cache(layer_ids, num_blocks, device)
        caches[("key", 0)] = caches[("key", 0)].flatten(1, 2)  # [n, tokens * heads, dim]
        return caches


class ZeroDimKey(GQABackend):
    def create_kv_cache(self, layer_ids, num_blocks, device):
        caches = super().create_kv_cache(layer_ids, num_blocks, device)
        caches[("key", 0)] = torch.tensor(0, dtype=torch.bfloat16)
        return caches


class NotATensor(GQABackend):
    def create_kv_cache(self, layer_ids, num_blocks, device):
        caches = super().create_kv_cache(layer_ids, num_blocks, device)
        caches[("key", 0)] = caches[("key", 0)].tolist()
        return caches


class UndeclaredRole(GQABackend):
    def create_kv_cache(self, layer_ids, num_blocks, device):
        caches = super().create_kv_cache(layer_ids, num_blocks, device)
        for layer in layer_ids:
            caches[("extra", layer)] = torch.zeros(num_blocks["kv"], 4, dtype=torch.uint8)
        return caches


class MissingRole(GQABackend):
    def create_kv_cache(self, layer_ids, num_blocks, device):
        caches = super().create_kv_cache(layer_ids, num_blocks, device)
        del caches[("value", 1)]
        return caches


class GappedBlock(GQABackend):
    def create_kv_cache(self, layer_ids, num_blocks, device):
        caches = super().create_kv_cache(layer_ids, num_blocks, device)
        n, tokens, heads, dim = caches[("key", 0)].shape
        caches[("key", 0)] = torch.zeros(n, tokens, heads, 2 * dim, dtype=torch.bfloat16)[..., :dim]
        return caches


class SharedKV(GQABackend):
    """value of layer 0 is key of layer 0 (one layer only, so exactly one pair overlaps)."""

    def create_kv_cache(self, layer_ids, num_blocks, device):
        caches = super().create_kv_cache(layer_ids, num_blocks, device)
        caches[("value", 0)] = caches[("key", 0)]
        return caches


class ShiftedKV(GQABackend):
    """value starts one block into key: the two share every block but key's first."""

    def create_kv_cache(self, layer_ids, num_blocks, device):
        caches = super().create_kv_cache(layer_ids, num_blocks, device)
        key = self.role("key")
        big = torch.zeros((num_blocks["kv"] + 1, *self.block_shape(key)), dtype=key.torch_dtype)
        caches[("key", 0)], caches[("value", 0)] = big[:-1], big[1:]
        return caches


class LossyHook(GQABackend):
    def after_swap_in(self, ctx):
        blocks = ctx.device_blocks["kv"]
        for layer in ctx.layer_ids:
            raw = ctx.caches[("key", layer)].view(torch.uint8)
            raw[blocks] = torch.bitwise_not(raw[blocks])


class Counting(GQABackend):
    """Counts cache_roles() calls from the end of construction on."""

    def __init__(self, *args):
        super().__init__(*args)
        self.asked = 0

    def cache_roles(self):
        self.asked = getattr(self, "asked", 0) + 1
        return super().cache_roles()


class FlippingRoles(Counting):
    """cache_roles() alternates its order from one call to the next."""

    def cache_roles(self):
        roles = super().cache_roles()
        return roles if self.asked % 2 else roles[::-1]


class GrowingRoles(Counting):
    """cache_roles() grows a role after its first call."""

    def cache_roles(self):
        roles = super().cache_roles()
        if self.asked > 1:
            roles.append(CacheRole(name="late", group="kv", entry_shape=(4,), dtype="uint8"))
        return roles


class DtypeDrift(Counting):
    """Same role names every call, but the dtype changes after the first call."""

    def cache_roles(self):
        roles = super().cache_roles()
        if self.asked > 1:
            roles[0] = roles[0].model_copy(update={"dtype": "float16"})
        return roles


class UndeclaredGroup(AttentionBackend):
    def cache_groups(self):
        return [CacheGroup(name="kv", block_size=4)]

    def cache_roles(self):
        return [CacheRole(name="key", group="nope", entry_shape=(8,), dtype="uint8")]


class Unvalidated(AttentionBackend):
    """A backend whose validate() checks nothing: the kit checks the declaration itself."""

    def __init__(self, groups, roles):
        self.groups, self.roles = groups, roles

    def validate(self):
        pass

    def cache_groups(self):
        return list(self.groups)

    def cache_roles(self):
        return list(self.roles)


KV4 = CacheGroup(name="kv", block_size=4)
KEY = CacheRole(name="key", group="kv", entry_shape=(8,), dtype="uint8")


class TupleRoles(GQABackend):
    def cache_roles(self):
        return tuple(super().cache_roles())


class SelectionPastTheEnd(GQABackend):
    def offload_selection(self, role, num_tokens, purpose):
        return TokenRange(start=0, end=num_tokens + 5)


class RaisingHook(GQABackend):
    def before_swap_out(self, ctx):
        raise RuntimeError("boom")


class LossyOnPrefix(GQABackend):
    """Zeroes the value entries of the last block after a prefix swap only."""

    def after_swap_in(self, ctx):
        if ctx.purpose is SwapPurpose.PREFIX:
            for layer in ctx.layer_ids:
                ctx.caches[("value", layer)][ctx.device_blocks["kv"][-1:]] = 0


G = "(num_kv_heads=2, head_dim=8, block_size=4, dtype='bfloat16')"
K0, V0 = "key_caches_0_rank0.device0 ('key', 0)", "value_caches_0_rank0.device0 ('value', 0)"
V1 = "value_caches_1_rank0.device0 ('value', 1)"

# (case, backend, check, message fragment): GQA with 2 kv heads * 8 dims, bf16, 4-token blocks,
# tokens=10 so num_blocks = 5 and every entry is 32 bytes
BROKEN = [
    (
        "wrong dtype",
        WrongDtype(2, 8, 4),
        "bytes",
        f"{K0} from WrongDtype{G}.create_kv_cache has dtype torch.float16, expected torch.bfloat16 "
        "(role 'key' declares dtype 'bfloat16')",
    ),
    (
        "wrong block bytes",
        WrongBlockBytes(2, 8, 4),
        "bytes",
        f"{V1} from WrongBlockBytes{G}.create_kv_cache: one block addresses 256 bytes, expected "
        "role.block_bytes = 4 entries * 32 B = 128 (shape (5, 4, 2, 16))",
    ),
    (
        "wrong block count",
        WrongBlockCount(2, 8, 4),
        "bytes",
        f"{K0} from WrongBlockCount{G}.create_kv_cache has block dim (4,), expected "
        "num_blocks['kv'] = 5",
    ),
    (
        "wrong shape, right bytes",
        WrongShapeRightBytes(2, 8, 4),
        "bytes",
        f"{K0} from WrongShapeRightBytes{G}.create_kv_cache has shape (5, 8, 8), expected (5, 4, 2, 8)",
    ),
    (
        "0-d tensor",
        ZeroDimKey(2, 8, 4),
        "bytes",
        f"{K0} from ZeroDimKey{G}.create_kv_cache is a 0-d tensor, expected dim 0 to hold "
        "num_blocks['kv'] = 5 blocks",
    ),
    (
        "not a tensor",
        NotATensor(2, 8, 4),
        "bytes",
        f"{K0} from NotATensor{G}.create_kv_cache is a list, expected a torch.Tensor",
    ),
    (
        "undeclared role",
        UndeclaredRole(2, 8, 4),
        "bytes",
        f"UndeclaredRole{G}.create_kv_cache returned [('extra', 0), ('extra', 1)], which its "
        "cache_roles() do not declare for layers [0, 1] (declared: ['key', 'value'])",
    ),
    (
        "missing role",
        MissingRole(2, 8, 4),
        "bytes",
        f"MissingRole{G}.create_kv_cache returned nothing for [('value', 1)]",
    ),
    (
        "block with gaps",
        GappedBlock(2, 8, 4),
        "bytes",
        f'plane "{K0} from GappedBlock{G}.create_kv_cache": a block of shape (4, 2, 8) with '
        "element strides (32, 16, 1) is not one contiguous run of bytes",
    ),
    (
        "key and value share one buffer",
        SharedKV(2, 8, 4),
        "no_overlap",
        f"create_kv_cache: {K0} from SharedKV{G}.create_kv_cache block 0 and {V0} from "
        f"SharedKV{G}.create_kv_cache block 0 share 128 bytes",
    ),
    (
        "value shifted one block into key",
        ShiftedKV(2, 8, 4),
        "no_overlap",
        f"create_kv_cache: {K0} from ShiftedKV{G}.create_kv_cache block 1 and {V0} from "
        f"ShiftedKV{G}.create_kv_cache block 0 share 128 bytes",
    ),
    (
        "lossy swap hook",
        LossyHook(2, 8, 4),
        "swap_round_trip",
        # key of both layers, 10 tokens each, of the 40 promised key and value entries
        "purpose 'preempt': 20 of 40 entries that offload_selection promises to keep differ after "
        f"swap out, overwrite and swap in; first: {K0} position 0",
    ),
    (
        "lossy hook on prefix swaps only",
        LossyOnPrefix(2, 8, 4),
        "swap_round_trip",
        # the value entries of the last block (tokens 8, 9) of both layers
        "purpose 'prefix': 4 of 40 entries",
    ),
    (
        "cache_roles() changes order between calls",
        FlippingRoles(2, 8, 4),
        "declaration",
        f"FlippingRoles{G}.cache_roles() returned different lists on calls 1 and 2: "
        "['key', 'value'] then ['value', 'key']; it must return the same list every call",
    ),
    (
        "cache_roles() grows between calls",
        GrowingRoles(2, 8, 4),
        "declaration",
        f"GrowingRoles{G}.cache_roles() returned different lists on calls 1 and 2: "
        "['key', 'value'] then ['key', 'value', 'late']",
    ),
    (
        "cache_roles() changes a dtype between calls",
        DtypeDrift(2, 8, 4),
        "declaration",
        f"DtypeDrift{G}.cache_roles() returned different lists on calls 1 and 2: item 0 ",
    ),
    (
        "role in an undeclared group",
        UndeclaredGroup(),
        "declaration",
        "UndeclaredGroup().validate() failed: UndeclaredGroup(): role 'key' names group 'nope', "
        "which is not declared (declared: ['kv'])",
    ),
    (
        "role declared twice",
        Unvalidated([KV4], [KEY, KEY]),
        "declaration",
        "Unvalidated() declares role 'key' twice",
    ),
    (
        "group declared twice, differently",
        Unvalidated([KV4, CacheGroup(name="kv", block_size=8)], [KEY]),
        "declaration",
        "Unvalidated() declares group 'kv' twice, differently: CacheGroup(name='kv', block_size=4",
    ),
    (
        "role of a group the backend does not declare",
        Unvalidated([CacheGroup(name="other", block_size=4)], [KEY]),
        "declaration",
        "Unvalidated(): role 'key' names group 'kv', which it does not declare (declared: ['other'])",
    ),
    ("no roles", Unvalidated([KV4], []), "declaration", "Unvalidated() declares no cache roles"),
    (
        "two layers declare one group differently",
        {0: GQABackend(2, 8, 4), 1: GQABackend(2, 8, 8)},
        "declaration",
        "CacheController(...) raised ValueError: group 'kv' is declared differently by layer 0",
    ),
    (
        "cache_roles() returns a tuple",
        TupleRoles(2, 8, 4),
        "declaration",
        f"TupleRoles{G}.cache_roles() must return a list of CacheRole, call 1 returned (CacheRole(",
    ),
    (
        "selection past the request",
        SelectionPastTheEnd(2, 8, 4),
        "swap_round_trip",
        f"SelectionPastTheEnd{G}.offload_selection('key', 10, 'preempt') returned "
        "TokenRange(start=0, end=15); expected a TokenRange within [0, 10]",
    ),
    (
        "hook that raises",
        RaisingHook(2, 8, 4),
        "swap_round_trip",
        "swap_out('conformance-preempt', 'preempt') raised RuntimeError: boom",
    ),
]


@pytest.mark.parametrize(
    ("case", "backend", "check", "fragment"), BROKEN, ids=[b[0] for b in BROKEN]
)
def test_broken_backend_fails_the_named_check(case, backend, check, fragment):
    with pytest.raises(ConformanceError) as info:
        check_backend(backend, tokens=10)
    error = info.value
    assert isinstance(error, AssertionError)
    assert error.check == check
    assert str(error).startswith(f"conformance check {check!r} failed: ")
    assert fragment in error.detail, error.detail


def test_lossy_hook_is_caught_after_a_clean_controller_free():
    freed = []

    class LossyAndCounted(LossyHook):
        def free_host_kv_cache(self, host_caches):
            freed.append(len(host_caches))
            super().free_host_kv_cache(host_caches)

    with pytest.raises(ConformanceError, match="'swap_round_trip' failed"):
        check_backend(LossyAndCounted(2, 8, 4), tokens=10)
    assert freed == [4]  # the kit freed its controller (and the host views) exactly once


def test_kit_catches_what_the_controller_lets_through(monkeypatch):
    # A controller whose index_of swaps key and value of layer 0 breaks the documented order
    real = CacheController.index_of

    def swapped(self, role, layer):
        index = real(self, role, layer)
        return index ^ 1 if layer == 0 else index

    monkeypatch.setattr(CacheController, "index_of", swapped)
    with pytest.raises(ConformanceError) as info:
        check_backend(GQABackend(2, 8, 4), tokens=10)
    assert info.value.check == "naming_and_order"
    assert info.value.detail.startswith(
        "index_of('key', 0) is 1, expected 0: the cache list is layer-major and follows "
        "cache_roles() within a layer, so it starts [('key', 0)]"
    )


def test_duplicate_storage_names_are_caught(monkeypatch):
    monkeypatch.setattr(CacheController, "storage_names", property(lambda self: ["same"] * 4))
    with pytest.raises(ConformanceError) as info:
        check_backend(GQABackend(2, 8, 4), tokens=10)
    assert info.value.check == "naming_and_order"
    assert info.value.detail == "storage name 'same' is given to both ('key', 0) and ('value', 0)"


# ---------------------------------------------------------------------- bad arguments


@pytest.mark.parametrize(
    ("args", "kwargs", "error", "message"),
    [
        (
            ("gqa",),
            {},
            TypeError,
            "backend_or_mapping must be an AttentionBackend or a mapping of layer id -> "
            "AttentionBackend, got str",
        ),
        (({},), {}, ValueError, "backend_or_mapping is an empty mapping: give at least one layer"),
        (
            ({-1: GQABackend(2, 8, 4)},),
            {},
            ValueError,
            "backend_or_mapping has layer id -1; layer ids are ints >= 0",
        ),
        (
            ({0: "gqa"},),
            {},
            TypeError,
            "backend_or_mapping[0] is a str, not an AttentionBackend",
        ),
        (
            (GQABackend(2, 8, 4),),
            {"purposes": "preempt"},
            TypeError,
            "purposes must be a sequence of swap purposes, got 'preempt'",
        ),
        (
            (GQABackend(2, 8, 4),),
            {"purposes": ("later",)},
            ValueError,
            "purposes has 'later'; each must be one of ['preempt', 'prefix']",
        ),
        (
            (GQABackend(2, 8, 4),),
            {"purposes": ("preempt", "preempt")},
            ValueError,
            "purposes lists 'preempt' twice",
        ),
        ((GQABackend(2, 8, 4),), {"tokens": 0}, ValueError, "tokens must be >= 1, got 0"),
        ((GQABackend(2, 8, 4),), {"tokens": 2.5}, TypeError, "tokens must be an int, got 2.5"),
        (
            (GQABackend(2, 8, 4),),
            {"num_blocks": 1},
            ValueError,
            "num_blocks['kv'] must be an int >= 2 (one usable block plus the reserved null "
            "block), got 1",
        ),
        (
            (GQABackend(2, 8, 4),),
            {"num_blocks": 4, "tokens": 10},
            ValueError,
            "num_blocks['kv'] = 4 is too small for tokens=10: the round trip may hold 3 blocks of "
            "the request, 1 of a second request and the null block, so it needs at least 5",
        ),
        (
            (GQABackend(2, 8, 4),),
            {"num_blocks": {"nope": 8}},
            ValueError,
            "num_blocks must name every group exactly: unknown ['nope'], missing ['kv'] "
            "(groups are ['kv'])",
        ),
        (
            (GQABackend(2, 8, 4),),
            {"num_blocks": {"kv": "8"}},
            ValueError,
            "num_blocks['kv'] must be an int >= 2 (one usable block plus the reserved null "
            "block), got '8'",
        ),
        (
            (GQABackend(2, 8, 4),),
            {"device": "nonsense"},
            ValueError,
            "device 'nonsense' is not a device",
        ),
    ],
)
def test_bad_arguments(args, kwargs, error, message):
    with pytest.raises(error) as info:
        check_backend(*args, **kwargs)
    assert str(info.value).startswith(message)
    assert not isinstance(info.value, ConformanceError)
    # nothing of the backend changed: the same object still passes
    if args and isinstance(args[0], GQABackend):
        assert check_backend(args[0], tokens=10).check("swap_round_trip").entries == 80
