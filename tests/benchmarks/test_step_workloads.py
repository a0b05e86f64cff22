"""``benchmarks/step_workloads.py``: the exact schedules both sides of the per-step benchmark
drive, and the table of bad workload definitions with their messages."""

from __future__ import annotations

import dataclasses

import pytest
from step_sim import load_step_workloads

SW = load_step_workloads()
KV = SW.GroupDef("kv", "full", 16, None, 16 * 4096)


def wl(**overrides):
    base = {
        "name": "w",
        "groups": (KV,),
        "num_requests": 2,
        "prompt_len": 1000,
        "max_num_batched_tokens": 1000,
        "decode_steps": 3,
        "chunk_size": 384,
        "max_model_len": 1100,
    }
    base.update(overrides)
    return SW.StepWorkload(**base)


def test_whole_prompt_schedule_of_llama() -> None:
    sched = SW.schedule(SW.workload("llama"))
    # 8192 // 2048 = 4 whole prompts per prefill step: 256 / 4 = 64 prefill steps
    assert sched.num_prefill_steps == 64 and sched.num_decode_steps == 32
    assert sched.steps[0] == SW.Step("prefill", tuple((i, 2048) for i in range(4)))
    assert sched.steps[63] == SW.Step("prefill", tuple((i, 2048) for i in range(252, 256)))
    assert sched.steps[64] == SW.Step("decode", tuple((i, 1) for i in range(256)))
    assert sched.finished == tuple(range(256))
    assert all(s.num_tokens == 8192 for s in sched.steps[:64])


def test_chunked_schedule_exact() -> None:
    sched = SW.schedule(wl())
    # budget 1000, chunks of 384: step 1 gives 384 to each (232 left, too few for a third
    # chunk), step 2 the same, step 3 the remainders 1000 - 768 = 232 each
    assert [s.scheduled for s in sched.steps] == [
        ((0, 384), (1, 384)),
        ((0, 384), (1, 384)),
        ((0, 232), (1, 232)),
        ((0, 1), (1, 1)),
        ((0, 1), (1, 1)),
        ((0, 1), (1, 1)),
    ]
    assert [s.phase for s in sched.steps] == ["prefill"] * 3 + ["decode"] * 3
    assert sched.finished == (0, 1)


def test_budget_stops_a_step_in_request_order() -> None:
    # budget 500, chunk 300: request 0 takes 300, request 1's 300 does not fit in 200 -> the
    # step ends; a request later in order is never served before an earlier one
    sched = SW.schedule(wl(max_num_batched_tokens=500, chunk_size=300, prompt_len=600))
    assert [s.scheduled for s in sched.steps if s.phase == "prefill"] == [
        ((0, 300),),
        ((0, 300),),
        ((1, 300),),
        ((1, 300),),
    ]


@pytest.mark.parametrize("w", SW.all_workloads(), ids=lambda w: w.name)
def test_every_prompt_token_once_within_budget(w) -> None:
    sched = SW.schedule(w)
    given = [0] * w.num_requests
    for step in sched.steps:
        assert step.num_tokens <= w.max_num_batched_tokens
        indices = [i for i, _ in step.scheduled]
        assert indices == sorted(set(indices))
        if step.phase == "prefill":
            for i, n in step.scheduled:
                given[i] += n
    assert given == [w.prompt_len] * w.num_requests
    assert sched.num_decode_steps == w.decode_steps
    assert SW.schedule(w) == sched  # a pure function of the workload


def test_scaling_and_chunked_counts() -> None:
    chunked = SW.schedule(SW.workload("chunked-prefill"))
    assert chunked.num_prefill_steps == 4096 // 512
    assert all(s.scheduled == tuple((i, 512) for i in range(16)) for s in chunked.steps[:8])
    for ctx, w in zip(SW.SCALING_CONTEXTS, SW.SCALING_WORKLOADS, strict=True):
        assert w.name == f"scaling-{ctx // 1024}k" and w.max_model_len == ctx + 1024
        assert SW.schedule(w).num_prefill_steps == ctx // 512
        assert w.total_tokens == ctx + 32


def test_unknown_workload() -> None:
    with pytest.raises(KeyError, match="unknown workload 'nope'; known: llama, gpt-oss"):
        SW.workload("nope")


GROUP_BAD = [
    ({"name": ""}, "GroupDef.name must be a non-empty string, got ''"),
    ({"kind": "state"}, "GroupDef.kind must be 'full' or 'sliding_window', got 'state' (group"),
    ({"block_size": 0}, "GroupDef.block_size must be a positive int, got 0 (group 'g')"),
    ({"block_size": True}, "GroupDef.block_size must be a positive int, got True (group 'g')"),
    ({"bytes_per_block": -1}, "GroupDef.bytes_per_block must be a positive int, got -1"),
    ({"window": 128}, "GroupDef.window must be None for a full group, got 128 (group 'g')"),
    (
        {"kind": "sliding_window", "window": None},
        "GroupDef.window must be a positive int, got None (group 'g')",
    ),
]


@pytest.mark.parametrize(("changes", "fragment"), GROUP_BAD)
def test_bad_group(changes: dict, fragment: str) -> None:
    fields = {
        "name": "g",
        "kind": "full",
        "block_size": 16,
        "window": None,
        "bytes_per_block": 1024,
    }
    fields.update(changes)
    with pytest.raises(ValueError) as info:
        SW.GroupDef(**fields)
    assert fragment in str(info.value)


WORKLOAD_BAD = [
    ({"name": ""}, "StepWorkload.name must be a non-empty string, got ''"),
    ({"groups": ()}, "StepWorkload.groups must be a non-empty tuple of GroupDef, got ()"),
    ({"groups": [KV]}, "StepWorkload.groups must be a non-empty tuple of GroupDef"),
    ({"groups": (KV, KV)}, "StepWorkload.groups has duplicate group names ['kv', 'kv']"),
    ({"num_requests": 0}, "StepWorkload.num_requests must be a positive int, got 0 (workload"),
    ({"prompt_len": 1.5}, "StepWorkload.prompt_len must be a positive int, got 1.5"),
    ({"max_model_len": False}, "StepWorkload.max_model_len must be a positive int, got False"),
    ({"decode_steps": -1}, "StepWorkload.decode_steps must be an int >= 0, got -1"),
    (
        {"chunk_size": None, "prompt_len": 1001, "max_model_len": 1100},
        "StepWorkload.prompt_len 1001 exceeds max_num_batched_tokens 1000 with chunk_size None",
    ),
    ({"chunk_size": 0}, "StepWorkload.chunk_size must be a positive int, got 0"),
    ({"chunk_size": 1001}, "StepWorkload.chunk_size 1001 exceeds max_num_batched_tokens 1000"),
    (
        {"num_requests": 1001},
        "StepWorkload.num_requests 1001 exceeds max_num_batched_tokens 1000: one decode step",
    ),
    (
        {"max_model_len": 1003},
        "StepWorkload.max_model_len 1003 is below prompt_len + decode_steps + 1 = 1004",
    ),
]


@pytest.mark.parametrize(("changes", "fragment"), WORKLOAD_BAD)
def test_bad_workload(changes: dict, fragment: str) -> None:
    with pytest.raises(ValueError) as info:
        wl(**changes)
    assert fragment in str(info.value)
    assert "(workload 'w')" in str(info.value) or changes == {"name": ""}


def test_frozen() -> None:
    w = wl()
    with pytest.raises(dataclasses.FrozenInstanceError):
        w.prompt_len = 5  # type: ignore[misc]
    assert w.prompt_len == 1000
    assert SW.workload("llama").num_requests == 256
