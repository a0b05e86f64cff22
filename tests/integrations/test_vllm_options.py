"""The ``"kvforge"`` options of ``kv_connector_extra_config`` are checked for type and against
the machine, once, at engine start: one ``ArgumentError`` naming the key, the value and what
this machine supports, never a raw torch error at the first transfer (issue 32, class 6)."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

pytest.importorskip(
    "vllm", reason="vLLM is not installed: pip install 'kvforge[vllm]' (docs/integrations/vllm.md)"
)
import torch

sys.path.insert(0, str(Path(__file__).parent))
from test_vllm_worker import packed_caches
from vllm_harness import build_offload_engine

import kvforge.integrations.vllm.worker as worker_module
from kvforge._checks import ArgumentError
from kvforge.integrations.vllm.config import (
    _TYPE_RULES,
    DEFAULT_HOST_BYTES,
    MACHINE_RULES,
    KVForgeOffloadOptions,
    MachineFacts,
    parse_options,
)
from kvforge.integrations.vllm.pages import plan_host_pages
from kvforge.integrations.vllm.worker import KVForgeOffloadingWorker

GiB = 1 << 30
#: a CPU-only machine with 8 GiB and no numba
CPU_BOX = MachineFacts("cpu", None, 8 * GiB, ("torch",))
#: a CUDA machine with 64 GiB
GPU_BOX = MachineFacts("cuda", "cuda", 64 * GiB, ("torch", "triton"))


def test_every_option_has_a_type_rule_and_a_machine_rule():
    # a new option cannot skip the machine check: its rule is a row of MACHINE_RULES
    fields = set(KVForgeOffloadOptions.model_fields)
    assert set(MACHINE_RULES) == fields
    assert set(_TYPE_RULES) == fields


# (machine, extra_config, message): the key, the value, what this machine supports
REFUSED = [
    (
        CPU_BOX,
        {"kvforge": {"gather_impl": "triton"}},
        r"^kvforge option 'gather_impl'='triton': the KV caches are on cpu, where this machine "
        r"runs 'torch' \('auto' picks the fastest\)",
    ),
    (
        CPU_BOX,
        {"kvforge": {"gather_impl": "cpu"}},
        r"^kvforge option 'gather_impl'='cpu': the KV caches are on cpu, where this machine runs "
        r"'torch'",
    ),
    (
        GPU_BOX,
        {"kvforge": {"gather_impl": "cpu"}},
        r"^kvforge option 'gather_impl'='cpu': the KV caches are on cuda, where this machine runs "
        r"'torch', 'triton' .*impl 'cpu' runs on cpu tensors only",
    ),
    (
        CPU_BOX,
        {"kvforge": {"pin_memory": True}},
        r"^kvforge option 'pin_memory'=True: this machine has no accelerator; pinned host memory "
        r"needs CUDA or an Ascend NPU",
    ),
    (
        CPU_BOX,
        {"kvforge": {"host_bytes": 9 * GiB}},
        r"^kvforge option 'host_bytes'=9663676416: this machine has 8,589,934,592 bytes of memory",
    ),
    (
        MachineFacts("cpu", None, 2 * GiB, ("torch",)),
        {},
        r"^kvforge option 'host_bytes'=4294967296 \(the default\): this machine has "
        r"2,147,483,648 bytes",
    ),
    (
        CPU_BOX,
        {"cpu_bytes_to_use": 9 * GiB},
        r"^kv_connector_extra_config option 'cpu_bytes_to_use'=9663676416: this machine has "
        r"8,589,934,592 bytes",
    ),
    (
        CPU_BOX,
        {"cpu_bytes_to_use": math.nan},
        r"^kv_connector_extra_config option 'cpu_bytes_to_use'=nan: must be a positive whole "
        r"number of bytes",
    ),
    (CPU_BOX, {"cpu_bytes_to_use": math.inf}, r"'cpu_bytes_to_use'=inf: must be a positive"),
    (CPU_BOX, {"cpu_bytes_to_use": -math.inf}, r"'cpu_bytes_to_use'=-inf: must be a positive"),
    (CPU_BOX, {"cpu_bytes_to_use": 0}, r"'cpu_bytes_to_use'=0: must be a positive"),
    (CPU_BOX, {"cpu_bytes_to_use": True}, r"'cpu_bytes_to_use'=True: must be a positive"),
    (CPU_BOX, {"cpu_bytes_to_use": "1GiB"}, r"'cpu_bytes_to_use'='1GiB': must be a positive"),
    (CPU_BOX, {"cpu_bytes_to_use": 1.5}, r"'cpu_bytes_to_use'=1.5: must be a positive whole"),
    # types and unknown keys, in the same form
    (
        CPU_BOX,
        {"kvforge": {"pin_memory": 1}},
        r"^kvforge option 'pin_memory'=1: must be true, false or null$",
    ),
    (CPU_BOX, {"kvforge": {"pin_memory": "yes"}}, r"^kvforge option 'pin_memory'='yes': must"),
    (
        CPU_BOX,
        {"kvforge": {"host_bytes": math.nan}},
        r"^kvforge option 'host_bytes'=nan: must be a positive int \(bytes\) or null$",
    ),
    (CPU_BOX, {"kvforge": {"host_bytes": math.inf}}, r"^kvforge option 'host_bytes'=inf: must"),
    (CPU_BOX, {"kvforge": {"host_bytes": 1.0}}, r"^kvforge option 'host_bytes'=1.0: must"),
    (CPU_BOX, {"kvforge": {"host_bytes": True}}, r"^kvforge option 'host_bytes'=True: must"),
    (CPU_BOX, {"kvforge": {"host_bytes": -1}}, r"^kvforge option 'host_bytes'=-1: must"),
    (
        CPU_BOX,
        {"kvforge": {"gather_impl": 3}},
        r"^kvforge option 'gather_impl'=3: must be one of 'auto', 'torch', 'cpu', 'triton'$",
    ),
    (CPU_BOX, {"kvforge": {"gather_impl": "cuda"}}, r"^kvforge option 'gather_impl'='cuda'"),
    (
        CPU_BOX,
        {"kvforge": {"gatherimpl": "torch"}},
        r"^kvforge option 'gatherimpl'='torch': no such option; kvforge's options are "
        r"'host_bytes', 'gather_impl', 'pin_memory', 'remote'$",
    ),
    (CPU_BOX, {"kvforge": "host_bytes=1"}, r"\['kvforge'\] must be an object"),
]


@pytest.mark.parametrize(("machine", "extra", "message"), REFUSED)
def test_options_are_refused_with_the_key_the_value_and_the_machine(machine, extra, message):
    with pytest.raises(ArgumentError, match=message):
        parse_options(extra, machine)


@pytest.mark.parametrize(
    ("machine", "extra", "host_bytes"),
    [
        (CPU_BOX, {}, DEFAULT_HOST_BYTES),
        (CPU_BOX, {"kvforge": {"gather_impl": "torch", "pin_memory": False}}, DEFAULT_HOST_BYTES),
        (CPU_BOX, {"kvforge": None}, DEFAULT_HOST_BYTES),
        (CPU_BOX, {"cpu_bytes_to_use": 2.0 * GiB}, 2 * GiB),  # vLLM's GiB * float
        (CPU_BOX, {"kvforge": {"host_bytes": 8 * GiB}}, 8 * GiB),  # all of it: allowed
        (GPU_BOX, {"kvforge": {"pin_memory": True, "gather_impl": "triton"}}, DEFAULT_HOST_BYTES),
        # host_bytes wins over cpu_bytes_to_use, which is then not read
        (CPU_BOX, {"kvforge": {"host_bytes": 7}, "cpu_bytes_to_use": math.nan}, 7),
    ],
)
def test_options_this_machine_runs_are_accepted(machine, extra, host_bytes):
    assert parse_options(extra, machine)[1] == host_bytes


def test_the_detected_machine_is_this_one():
    machine = MachineFacts.detect()
    has_accelerator = torch.cuda.is_available()
    assert (machine.accelerator is not None) == has_accelerator
    assert machine.host_memory and machine.host_memory > 0
    assert "torch" in machine.gather_impls
    if not has_accelerator:  # the default machine: the check needs no injected facts
        with pytest.raises(ArgumentError, match="'pin_memory'=True: this machine has no acc"):
            parse_options({"kvforge": {"pin_memory": True}})
    else:  # pragma: no cover - a lent GPU machine
        assert parse_options({"kvforge": {"pin_memory": True}})[0].pin_memory is True


# ------------------------------------------------------------------ at engine start


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (
            {"kvforge": {"gather_impl": "triton"}},
            r"^kvforge option 'gather_impl'='triton': the KV caches are on cpu, where this machine "
            r"runs 'torch'",
        ),
        (
            {"kvforge": {"host_bytes": 1 << 60}},
            r"^kvforge option 'host_bytes'=1152921504606846976: this machine has [\d,]+ bytes",
        ),
        ({"cpu_bytes_to_use": math.nan}, r"'cpu_bytes_to_use'=nan: must be a positive whole"),
    ]
    + (
        []
        if torch.cuda.is_available()
        else [({"kvforge": {"pin_memory": True}}, r"'pin_memory'=True: this machine has no acc")]
    ),
)
def test_engine_start_refuses_what_this_machine_cannot_run(extra, message, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # triton on CPU is for tests only
    with pytest.raises(ArgumentError, match=message):
        build_offload_engine(
            "llama",
            num_gpu_blocks=64,
            kv_connector="KVForgeConnector",
            kv_connector_module_path="kvforge.integrations.vllm",
            extra_config=extra,
        )


# ------------------------------------------------------------------ the worker's own check


def plan(pages: int = 4):
    _, block_bytes = packed_caches()
    return plan_host_pages([0, 3], block_bytes, 1, sum(block_bytes) * pages)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"impl": "triton"},
            r"^kvforge option 'gather_impl'='triton': the KV caches are on cpu, where this machine "
            r"runs .*needs the Triton interpreter",
        ),
        ({"impl": 3}, r"^kvforge option 'gather_impl'=3: must be one of"),
        ({"impl": "fast"}, r"^kvforge option 'gather_impl'='fast': .*not one of"),
        ({"pin_memory": "yes"}, r"^kvforge option 'pin_memory'='yes': must be true, false"),
        (
            {"machine": CPU_BOX, "pin_memory": True},
            r"^kvforge option 'pin_memory'=True: this machine has no accelerator",
        ),
        (
            {"machine": MachineFacts("cpu", None, 100, ("torch",))},
            r"^kvforge option 'host_bytes'=512: its pages take 512 B; this machine has 100 bytes",
        ),
    ],
)
def test_the_worker_checks_its_options_against_its_caches(kwargs, message, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    caches, _ = packed_caches()
    with pytest.raises(ArgumentError, match=message):
        KVForgeOffloadingWorker(caches, plan(), **kwargs)


def test_a_host_allocation_failure_names_host_bytes(monkeypatch):
    def no_memory(*args, **kwargs):
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory")

    monkeypatch.setattr(worker_module.torch, "empty", no_memory)
    caches, _ = packed_caches()
    with pytest.raises(
        ArgumentError,
        match=r"^kvforge option 'host_bytes'=512: allocating 512 B "
        r"of host pages failed on this machine .*can't allocate memory",
    ):
        KVForgeOffloadingWorker(caches, plan(), impl="torch")


def test_the_worker_resolves_its_implementation_once_and_pins_only_for_accelerators():
    caches, _ = packed_caches()
    w = KVForgeOffloadingWorker(caches, plan(), impl="auto")
    assert w.impls == [w.impls[0]] * 2 and w.impls[0] in MachineFacts.detect("cpu").gather_impls
    assert w.pin_memory is False  # CPU caches: nothing to DMA from
    assert KVForgeOffloadingWorker(caches, plan(), impl="torch").impls == ["torch", "torch"]
