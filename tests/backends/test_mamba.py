"""The Mamba2 state backend: its declaration, its bytes (hand arithmetic beside each figure),
a byte-exact swap round trip through the controller, and its snapshot at an aligned boundary
through the scheduler's prefix cache.

Shapes are vLLM's ``MambaStateShapeCalculator.mamba2_state_shape`` (default ``"SD"`` conv
layout): conv ``[kernel - 1 + spec, (inner + 2 * groups' * state) / tp]``, SSM
``[heads / tp, head_dim, state]``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvforge import CacheController, GQABackend
from kvforge._checks import ArgumentError
from kvforge.attn_backends.mamba import MAMBA_STATE_GROUP, Mamba2Backend
from kvforge.core.layout import CacheLayout
from kvforge.core.values import PrefixQuery
from kvforge.specs import GroupKind, SwapPurpose, TokenRange
from kvforge.verify import (
    entry_bytes_for,
    read_entries,
    token_seeds,
    verify_request,
    write_entries,
    write_request,
    write_step,
)

# ------------------------------------------------------------------ declaration and bytes


def test_declaration_one_per_request_group_two_roles():
    backend = Mamba2Backend(8, 16, 32, 4, n_groups=2)
    (group,) = backend.cache_groups()
    assert (group.name, group.kind, group.block_size, group.slots_per_request) == (
        MAMBA_STATE_GROUP,
        GroupKind.PER_REQUEST,
        1,
        1,
    )
    assert [r.name for r in backend.cache_roles()] == ["conv_state", "ssm_state"]
    # conv_dim = 8 * 16 + 2 * 2 * 32 = 256; conv [4 - 1, 256], ssm [8, 16, 32], both bf16
    assert backend.conv_dim == 256
    assert backend.role("conv_state").entry_shape == (3, 256)
    assert backend.role("ssm_state").entry_shape == (8, 16, 32)
    assert {r.dtype for r in backend.cache_roles()} == {"bfloat16"}
    assert backend.conv_state_bytes == 3 * 256 * 2 == 1_536
    assert backend.ssm_state_bytes == 8 * 16 * 32 * 2 == 8_192
    assert backend.state_bytes_per_request() == 1_536 + 8_192 == 9_728
    assert backend.snapshot_policy == "aligned"


# (kwargs, conv shape, ssm shape, bytes per request): each line's arithmetic beside it
SHAPES = [
    # Falcon-H1-7B: inner 3072 + 2 * 1 * 256 = 3584; 3 * 3584 * 2 + 24 * 128 * 256 * 2
    (dict(num_heads=24, head_dim=128, state_size=256, conv_kernel_size=4), (3, 3584),
     (24, 128, 256), 21_504 + 1_572_864),
    # Nemotron-Nano-9B-v2, SSM in float32: inner 10240 + 2 * 8 * 128 = 12288
    # 3 * 12288 * 2 + 128 * 80 * 128 * 4 = 73,728 + 5,242,880
    (dict(num_heads=128, head_dim=80, state_size=128, conv_kernel_size=4, n_groups=8,
          ssm_dtype="float32"), (3, 12288), (128, 80, 128), 73_728 + 5_242_880),
    # tp 4 divides 8 groups: (10240 + 2 * 8 * 128) / 4 = 3072 channels, 128 / 4 = 32 heads
    (dict(num_heads=128, head_dim=80, state_size=128, conv_kernel_size=4, n_groups=8,
          tp_size=4), (3, 3072), (32, 80, 128), 3 * 3072 * 2 + 32 * 80 * 128 * 2),
    # tp 2 over one group: the group is replicated, groups' = 2: (3072 + 2 * 2 * 256) / 2
    (dict(num_heads=24, head_dim=128, state_size=256, conv_kernel_size=4, tp_size=2),
     (3, 2048), (12, 128, 256), 3 * 2048 * 2 + 12 * 128 * 256 * 2),
    # 2 draft tokens: the conv window is 3 + 2 and each request holds 1 + 2 slots
    (dict(num_heads=8, head_dim=16, state_size=32, conv_kernel_size=4,
          num_speculative_tokens=2), (5, 8 * 16 + 2 * 32), (8, 16, 32),
     3 * (5 * 192 * 2 + 8 * 16 * 32 * 2)),
    # an intermediate size that is not heads * head_dim (mamba_d_ssm), fp16 conv
    (dict(num_heads=4, head_dim=8, state_size=16, conv_kernel_size=2, intermediate_size=64,
          conv_dtype="float16"), (1, 64 + 32), (4, 8, 16), 1 * 96 * 2 + 4 * 8 * 16 * 2),
]  # fmt: skip


@pytest.mark.parametrize(("kwargs", "conv", "ssm", "per_request"), SHAPES)
def test_shapes_and_bytes_against_hand_arithmetic(kwargs, conv, ssm, per_request):
    backend = Mamba2Backend(**kwargs)
    assert backend.role("conv_state").entry_shape == conv
    assert backend.role("ssm_state").entry_shape == ssm
    assert backend.state_bytes_per_request() == per_request
    assert CacheLayout({0: backend, 1: backend}).bytes_per_request() == 2 * per_request


def test_page_padding_ends_the_page_and_host_pages_stay_unpadded():
    backend = Mamba2Backend(24, 128, 256, 4, page_size_padded=1_605_632)
    (group,) = backend.cache_groups()
    conv, ssm = backend.cache_roles()
    # 21,504 + 1,572,864 = 1,594,368 meaningful; the SSM block is padded to end at 1,605,632
    assert conv.device_block_bytes(group) == 21_504
    assert ssm.device_block_bytes(group) == 1_605_632 - 21_504
    assert sum(r.block_bytes(group) for r in (conv, ssm)) == 1_594_368
    assert backend.state_bytes_per_request() == 1_594_368
    assert Mamba2Backend(24, 128, 256, 4, page_size_padded=1_594_368).page_size_padded == (
        1_594_368
    )


def test_options_rebuild_the_same_declaration():
    backend = Mamba2Backend(8, 16, 32, 4, n_groups=2, tp_size=2, ssm_dtype="float32")
    again = Mamba2Backend(**backend.options())
    assert again.cache_roles() == backend.cache_roles()
    assert again.cache_groups() == backend.cache_groups()
    assert (
        repr(again)
        == repr(backend)
        == (
            "Mamba2Backend(num_heads=8, head_dim=16, state_size=32, conv_kernel_size=4, "
            "n_groups=2, conv_dtype='bfloat16', ssm_dtype='float32', tp_size=2)"
        )
    )


def test_offload_selection_is_the_whole_state():
    backend = Mamba2Backend(8, 16, 32, 4)
    for role in backend.cache_roles():
        for purpose in SwapPurpose:
            assert backend.offload_selection(role, 57, purpose) == TokenRange(start=0, end=57)


A = ArgumentError
BAD = [
    (dict(num_heads=0), "Mamba2Backend: num_heads must be a positive number of heads, got 0"),
    (dict(head_dim=2.0), "Mamba2Backend: head_dim must be an int, got 2.0 (float)"),
    (dict(state_size=True), "Mamba2Backend: state_size must be an int, got True (bool)"),
    (dict(conv_kernel_size=1), "Mamba2Backend: conv_kernel_size must be >= 2, got 1"),
    (dict(n_groups=0), "Mamba2Backend: n_groups must be a positive number of groups, got 0"),
    (dict(num_speculative_tokens=-1), "num_speculative_tokens must be >= 0, got -1"),
    (dict(tp_size=3), "Mamba2Backend: tp_size=3 does not divide num_heads=8"),
    (
        dict(tp_size=2, intermediate_size=7, num_heads=2),
        "tp_size=2 does not divide the conv channels 135",
    ),
    (dict(conv_dtype="int4"), "Mamba2Backend: conv_dtype: dtype 'int4' is not supported"),
    (dict(ssm_dtype=3), "Mamba2Backend: ssm_dtype must be a torch.dtype or a string, got 3"),
    (dict(page_size_padded=100), "page_size_padded=100 is below the 9728 bytes"),
    (dict(page_size_padded=-5), "page_size_padded must be a positive int, got -5"),
]


@pytest.mark.parametrize(("change", "message"), BAD)
def test_bad_input_names_the_argument_and_value(change, message):
    args = dict(num_heads=8, head_dim=16, state_size=32, conv_kernel_size=4, n_groups=2)
    args.update(change)
    with pytest.raises(A) as info:
        Mamba2Backend(**args)
    assert message in str(info.value)


# ------------------------------------------------------------------ through the controller

SMALL = Mamba2Backend(4, 8, 16, 4, ssm_dtype="float32")
# conv [3, 4 * 8 + 2 * 16] = [3, 64] bf16 = 384 B; ssm [4, 8, 16] f32 = 2,048 B; 2,432 B
SMALL_STATE = 3 * 64 * 2 + 4 * 8 * 16 * 4
MIXERS = (0, 1, 3)


def small_controller(**kwargs) -> CacheController:
    backends = {0: SMALL, 1: SMALL, 2: GQABackend(1, 8, 16), 3: SMALL}
    ctl = CacheController(backends, **kwargs)
    ctl.initialize_kv_cache(
        num_blocks={MAMBA_STATE_GROUP: 8, "kv": 80}, max_num_seqs=4, max_model_len=1024
    )
    return ctl


def test_controller_sizes_and_names_the_states():
    assert SMALL_STATE == 2_432
    ctl = small_controller()
    assert ctl.layout.bytes_per_request() == 3 * SMALL_STATE
    assert ctl.bytes_per_block(MAMBA_STATE_GROUP) == 3 * SMALL_STATE
    assert ctl.storage_names[:4] == [
        "conv_state_caches_0_rank0.device0",
        "ssm_state_caches_0_rank0.device0",
        "conv_state_caches_1_rank0.device0",
        "ssm_state_caches_1_rank0.device0",
    ]
    conv, ssm = ctl.get("conv_state", 3), ctl.get("ssm_state", 3)
    assert (tuple(conv.shape), conv.dtype) == ((8, 1, 3, 64), torch.bfloat16)
    assert (tuple(ssm.shape), ssm.dtype) == ((8, 1, 4, 8, 16), torch.float32)


def _states(ctl, rid, seed=None):
    (slot,) = ctl.block_table(rid, MAMBA_STATE_GROUP)
    out, gen = {}, torch.Generator().manual_seed(seed or 0)
    for layer in MIXERS:
        for role in ("conv_state", "ssm_state"):
            raw = ctl.get(role, layer)[slot].view(torch.uint8).view(-1)
            if seed is not None:
                raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=gen))
            out[(role, layer)] = raw.clone().numpy().tobytes()
    return out


@pytest.mark.parametrize("purpose", ["preempt", "prefix"])
def test_swap_round_trip_is_byte_exact(purpose):
    ctl = small_controller()
    ctl.initialize_host_cache(num_pages={MAMBA_STATE_GROUP: 4, "kv": 8})
    ctl.allocate("other", 5)
    ctl.allocate("r", 40)
    written = _states(ctl, "r", seed=7)
    write_request(ctl, "r", 11, range(40), groups=["kv"])
    (old,) = ctl.block_table("r", MAMBA_STATE_GROUP)
    handle = ctl.swap_out("r", purpose=purpose)
    handle.wait()
    # the whole state moves for either purpose: one slot, and the 3 kv blocks of 40 tokens
    assert handle.blocks_moved == {MAMBA_STATE_GROUP: 1, "kv": 3}
    for layer in MIXERS:
        for role in ("conv_state", "ssm_state"):
            ctl.get(role, layer)[old].view(torch.uint8).fill_(0xAB)
    ctl.allocate("intruder", 3)
    _states(ctl, "intruder", seed=99)
    ctl.swap_in("r").wait()
    assert _states(ctl, "r") == written
    check = verify_request(ctl, "r", 11, skip_groups=[MAMBA_STATE_GROUP])
    assert (check.entries, check.mismatched) == (2 * 40, 0)


def test_a_request_holds_one_slot_whatever_its_length():
    ctl = small_controller()
    free = ctl.num_free_blocks(MAMBA_STATE_GROUP)
    for n in (1, 17, 333):
        ctl.allocate("r", n)
        assert len(ctl.block_table("r", MAMBA_STATE_GROUP)) == 1
        assert ctl.num_free_blocks(MAMBA_STATE_GROUP) == free - 1
    ctl.free_request("r")
    assert ctl.num_free_blocks(MAMBA_STATE_GROUP) == free


def test_state_is_snapshotted_at_an_aligned_boundary_and_restored():
    # one mixer (one slot per request) beside a full layer of 16-token blocks; snapshots at
    # multiples of the default 512-token interval
    ctl = CacheController({0: SMALL, 1: GQABackend(1, 8, 16)}, enable_prefix_caching=True)
    ctl.initialize_kv_cache(num_blocks={MAMBA_STATE_GROUP: 8, "kv": 80})
    state = [e for e in ctl.layout.buffers if e.group.name == MAMBA_STATE_GROUP]

    def write_state(rid, seeds, n):  # the state after n tokens is a function of the prefix
        slot = torch.tensor(ctl.block_table(rid, MAMBA_STATE_GROUP))
        for e in state:
            data = entry_bytes_for(seeds, e, torch.tensor([n - 1]), e.role.entry_bytes)
            write_entries(ctl.get(e.role.name, e.layer), e, slot, data)

    def read_state(rid):
        slot = torch.tensor(ctl.block_table(rid, MAMBA_STATE_GROUP))
        return [read_entries(ctl.get(e.role.name, e.layer), e, slot) for e in state]

    a = np.random.default_rng(0).integers(0, 50_000, 600)
    seeds_a, done = token_seeds(a), 0
    while done < 600:
        step = ctl.schedule(["a"], [min(128, 600 - done)], new_token_ids=[a[done : done + 128]])
        n = int(step.allocation.num_new[0])
        write_step(ctl, step, {"a": seeds_a})
        write_state("a", seeds_a, done + n)
        ctl.end_step(step)
        if done + n == 512:
            at_512 = read_state("a")
        done += n
    ctl.free_request("a")
    b = np.random.default_rng(4).integers(0, 50_000, 700)
    b[:600] = a
    [match] = ctl.lookup([PrefixQuery(b)])
    assert match.num_tokens == 512  # the snapshot's boundary, though 592 tokens of history match
    step = ctl.schedule(["b"], [64], new_token_ids=[b[512:576]], prefix_matches=[match])
    assert [c.group for c in step.allocation.copies_before] == [MAMBA_STATE_GROUP]
    got = read_state("b")
    assert all(torch.equal(x, y) for x, y in zip(got, at_512, strict=True))
    write_step(ctl, step, {"b": token_seeds(b)})
    assert (
        verify_request(ctl, "b", token_seeds(b), skip_groups=(MAMBA_STATE_GROUP,)).mismatched == 0
    )
