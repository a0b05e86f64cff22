"""Step workloads shared by the kvforge and the vLLM side of the per-step benchmarks.

A workload names the cache groups of a model (block size, window, bytes per block), how many
requests run, how long their prompts are, how prompts are admitted (whole prompts per step, or
fixed chunks) and how many decode steps follow. :func:`schedule` turns a workload into the exact
list of steps both sides drive, so a figure from one side and a figure from the other always
describe the same work.

This module is plain Python: it imports neither kvforge nor vLLM, so either side (and a runner
that has only one of them installed) can load it.

Invariants:

- Every definition is a frozen dataclass, validated on construction; a bad value raises
  ``ValueError`` naming the field and the value.
- :func:`schedule` is a pure function of the workload: the same workload always gives the same
  steps, in the same order. Within a step requests appear in ascending index order.
- Every prompt token is scheduled exactly once, and no step schedules more than
  ``max_num_batched_tokens`` tokens.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Literal

__all__ = [
    "DEEPSEEK_V4_TINY_GROUPS",
    "GPT_OSS_GROUPS",
    "LLAMA_GROUPS",
    "SCALING_CONTEXTS",
    "SCALING_WORKLOADS",
    "STEP_WORKLOADS",
    "GroupDef",
    "Schedule",
    "Step",
    "StepWorkload",
    "all_workloads",
    "schedule",
    "workload",
]

GroupKindName = Literal["full", "sliding_window"]
Phase = Literal["prefill", "decode"]


@dataclass(frozen=True)
class GroupDef:
    """One cache group: a block table shared by the layers of one attention kind.

    Attributes:
        name: group name (``kv``, ``swa``, ``compressed``, ...).
        kind: ``full`` (every block kept) or ``sliding_window`` (only blocks covering the last
            ``window`` tokens stay live; compressor state groups are expressed this way too).
        block_size: tokens per block.
        window: tokens kept by a ``sliding_window`` group; ``None`` for ``full``.
        bytes_per_block: bytes one block of this group occupies in one layer's cache (vLLM's
            ``page_size_bytes``); it sizes the caches, never the bookkeeping.
    """

    name: str
    kind: GroupKindName
    block_size: int
    window: int | None
    bytes_per_block: int

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"GroupDef.name must be a non-empty string, got {self.name!r}")
        if self.kind not in ("full", "sliding_window"):
            raise ValueError(
                f"GroupDef.kind must be 'full' or 'sliding_window', got {self.kind!r} "
                f"(group {self.name!r})"
            )
        _check_positive_int("GroupDef.block_size", self.block_size, f"group {self.name!r}")
        _check_positive_int(
            "GroupDef.bytes_per_block", self.bytes_per_block, f"group {self.name!r}"
        )
        if self.kind == "full" and self.window is not None:
            raise ValueError(
                f"GroupDef.window must be None for a full group, got {self.window!r} "
                f"(group {self.name!r})"
            )
        if self.kind == "sliding_window":
            _check_positive_int("GroupDef.window", self.window, f"group {self.name!r}")


@dataclass(frozen=True)
class StepWorkload:
    """A batch of identical requests driven through prefill and decode steps.

    Attributes:
        name: workload name, unique among the workloads of a run.
        groups: the model's cache groups, in block-table order.
        num_requests: requests in the batch (they all decode together).
        prompt_len: prompt tokens per request.
        max_num_batched_tokens: token budget of one step.
        decode_steps: decode steps after the last prompt token is scheduled; each decode step
            schedules one token of every request.
        chunk_size: ``None``: each prefill step admits as many whole prompts as the budget holds.
            Otherwise every request still prefilling advances by one chunk of this many tokens
            (the prompt's remainder for its last chunk) per step, in request order, while the
            budget holds the next chunk.
        max_model_len: the engine's maximum sequence length (sizes block-table rows).
    """

    name: str
    groups: tuple[GroupDef, ...]
    num_requests: int
    prompt_len: int
    max_num_batched_tokens: int
    decode_steps: int
    chunk_size: int | None
    max_model_len: int

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"StepWorkload.name must be a non-empty string, got {self.name!r}")
        if not isinstance(self.groups, tuple) or not self.groups:
            raise ValueError(
                f"StepWorkload.groups must be a non-empty tuple of GroupDef, got {self.groups!r} "
                f"(workload {self.name!r})"
            )
        names = [g.name for g in self.groups]
        if len(set(names)) != len(names):
            raise ValueError(
                f"StepWorkload.groups has duplicate group names {names!r} (workload {self.name!r})"
            )
        for field in ("num_requests", "prompt_len", "max_num_batched_tokens", "max_model_len"):
            _check_positive_int(
                f"StepWorkload.{field}", getattr(self, field), f"workload {self.name!r}"
            )
        if not isinstance(self.decode_steps, int) or self.decode_steps < 0:
            raise ValueError(
                f"StepWorkload.decode_steps must be an int >= 0, got {self.decode_steps!r} "
                f"(workload {self.name!r})"
            )
        if self.chunk_size is None:
            if self.prompt_len > self.max_num_batched_tokens:
                raise ValueError(
                    f"StepWorkload.prompt_len {self.prompt_len} exceeds max_num_batched_tokens "
                    f"{self.max_num_batched_tokens} with chunk_size None (workload {self.name!r})"
                )
        else:
            _check_positive_int(
                "StepWorkload.chunk_size", self.chunk_size, f"workload {self.name!r}"
            )
            if self.chunk_size > self.max_num_batched_tokens:
                raise ValueError(
                    f"StepWorkload.chunk_size {self.chunk_size} exceeds max_num_batched_tokens "
                    f"{self.max_num_batched_tokens} (workload {self.name!r})"
                )
        if self.decode_steps > 0 and self.num_requests > self.max_num_batched_tokens:
            raise ValueError(
                f"StepWorkload.num_requests {self.num_requests} exceeds max_num_batched_tokens "
                f"{self.max_num_batched_tokens}: one decode step could not hold every request "
                f"(workload {self.name!r})"
            )
        # A request ends holding prompt_len + decode_steps + 1 tokens (the last sampled token is
        # never scheduled), and an engine refuses a request longer than max_model_len.
        needed = self.prompt_len + self.decode_steps + 1
        if self.max_model_len < needed:
            raise ValueError(
                f"StepWorkload.max_model_len {self.max_model_len} is below prompt_len + "
                f"decode_steps + 1 = {needed} (workload {self.name!r})"
            )

    @property
    def total_tokens(self) -> int:
        """Tokens each request has scheduled once the last decode step ran."""
        return self.prompt_len + self.decode_steps


@dataclass(frozen=True)
class Step:
    """One engine step.

    Attributes:
        phase: ``prefill`` (prompt tokens only) or ``decode`` (one token of every request).
        scheduled: ``(request index, num_new_tokens)`` pairs in ascending request index.
    """

    phase: Phase
    scheduled: tuple[tuple[int, int], ...]

    @property
    def num_tokens(self) -> int:
        """Tokens scheduled in this step."""
        return sum(n for _, n in self.scheduled)


@dataclass(frozen=True)
class Schedule:
    """Every step of a workload, and the requests that finish after the last one.

    Attributes:
        steps: the steps, prefill steps first.
        finished: request indices freed after the last step, in ascending order.
    """

    steps: tuple[Step, ...]
    finished: tuple[int, ...]

    @property
    def num_prefill_steps(self) -> int:
        return sum(1 for s in self.steps if s.phase == "prefill")

    @property
    def num_decode_steps(self) -> int:
        return sum(1 for s in self.steps if s.phase == "decode")


def schedule(wl: StepWorkload) -> Schedule:
    """The steps that run ``wl``: prefill steps, then ``wl.decode_steps`` decode steps.

    Whole prompts (``chunk_size`` None): step k admits requests
    ``[k * per_step, (k + 1) * per_step)`` with ``per_step = max_num_batched_tokens //
    prompt_len``, each with its whole prompt. Chunked: each step walks the requests still
    prefilling in index order and gives each ``min(chunk_size, tokens left)`` while that fits in
    what is left of the budget. A decode step schedules one token of every request.
    """
    steps: list[Step] = []
    if wl.chunk_size is None:
        per_step = wl.max_num_batched_tokens // wl.prompt_len
        for first in range(0, wl.num_requests, per_step):
            last = min(first + per_step, wl.num_requests)
            steps.append(
                Step(
                    phase="prefill", scheduled=tuple((i, wl.prompt_len) for i in range(first, last))
                )
            )
    else:
        remaining = [wl.prompt_len] * wl.num_requests
        while any(remaining):
            budget = wl.max_num_batched_tokens
            scheduled: list[tuple[int, int]] = []
            for i, left in enumerate(remaining):
                if left == 0:
                    continue
                n = min(wl.chunk_size, left)
                if n > budget:
                    break
                scheduled.append((i, n))
                remaining[i] -= n
                budget -= n
            steps.append(Step(phase="prefill", scheduled=tuple(scheduled)))
    decode = tuple((i, 1) for i in range(wl.num_requests))
    steps.extend(Step(phase="decode", scheduled=decode) for _ in range(wl.decode_steps))
    return Schedule(steps=tuple(steps), finished=tuple(range(wl.num_requests)))


def _check_positive_int(field: str, value: object, owner: str) -> None:
    # bool is an int subclass; True as a block size is a bug, not a 1.
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{field} must be a positive int, got {value!r} ({owner})")


# --- groups -------------------------------------------------------------------------------------

# Llama-3-8B: 8 KV heads x head_dim 128 x (K + V) x 2 bytes (bf16) = 4096 bytes per token per
# layer; a block of 16 tokens is 65536 bytes.
LLAMA_GROUPS: tuple[GroupDef, ...] = (
    GroupDef(name="kv", kind="full", block_size=16, window=None, bytes_per_block=16 * 4096),
)

# gpt-oss: 8 KV heads x head_dim 64 x (K + V) x 2 bytes = 2048 bytes per token per layer, on the
# full-attention and on the sliding-window (128 tokens) layers alike; 16 tokens = 32768 bytes.
GPT_OSS_GROUPS: tuple[GroupDef, ...] = (
    GroupDef(name="kv", kind="full", block_size=16, window=None, bytes_per_block=16 * 2048),
    GroupDef(
        name="swa", kind="sliding_window", block_size=16, window=128, bytes_per_block=16 * 2048
    ),
)

# DeepSeek-V4 (fp8 cache), the four groups of kvforge's deepseek_v4 backend:
# - swa: 584-byte entries (448 fp8 + 64 bf16 rope + 8 scale bytes), 64 tokens = 37376 bytes;
# - compressed: a ratio-4 layer stores 256 / 4 = 64 entries of 584 bytes = 37376 bytes;
# - c4_state: float32 compressor state 2*2*512 + indexer state 2*2*128 = 2560 values = 10240
#   bytes per position, 4 positions = 40960 bytes;
# - c128_state: float32 compressor state 2*512 values = 4096 bytes per position, 8 positions =
#   32768 bytes.
DEEPSEEK_V4_TINY_GROUPS: tuple[GroupDef, ...] = (
    GroupDef(name="swa", kind="sliding_window", block_size=64, window=128, bytes_per_block=37376),
    GroupDef(name="compressed", kind="full", block_size=256, window=None, bytes_per_block=37376),
    GroupDef(name="c4_state", kind="sliding_window", block_size=4, window=8, bytes_per_block=40960),
    GroupDef(
        name="c128_state", kind="sliding_window", block_size=8, window=128, bytes_per_block=32768
    ),
)

# --- workloads ----------------------------------------------------------------------------------

# 256 requests of 2048 prompt tokens, 8192 tokens per step = 4 whole prompts per prefill step
# (64 prefill steps), then 32 decode steps of all 256 requests. 2048 + 32 + 1 tokens fit in 4096.
_STANDARD = {
    "num_requests": 256,
    "prompt_len": 2048,
    "max_num_batched_tokens": 8192,
    "decode_steps": 32,
    "chunk_size": None,
    "max_model_len": 4096,
}

STEP_WORKLOADS: tuple[StepWorkload, ...] = (
    StepWorkload(name="llama", groups=LLAMA_GROUPS, **_STANDARD),
    StepWorkload(name="gpt-oss", groups=GPT_OSS_GROUPS, **_STANDARD),
    StepWorkload(name="deepseek-v4-tiny", groups=DEEPSEEK_V4_TINY_GROUPS, **_STANDARD),
    # 16 requests x 512-token chunks = 8192 tokens per step: every request advances one chunk
    # per step, 4096 / 512 = 8 prefill steps, then 32 decode steps.
    StepWorkload(
        name="chunked-prefill",
        groups=DEEPSEEK_V4_TINY_GROUPS,
        num_requests=16,
        prompt_len=4096,
        max_num_batched_tokens=8192,
        decode_steps=32,
        chunk_size=512,
        max_model_len=8192,
    ),
)

SCALING_CONTEXTS: tuple[int, ...] = (2048, 16384, 65536, 262144)

# Decode cost against context length: 16 requests reach each context in 512-token chunks (the
# chunked-prefill schedule), then decode 32 steps. max_model_len is raised to context + 1024 so
# that the longest request fits with room to spare, as an engine configured for it would be.
SCALING_WORKLOADS: tuple[StepWorkload, ...] = tuple(
    StepWorkload(
        name=f"scaling-{ctx // 1024}k",
        groups=DEEPSEEK_V4_TINY_GROUPS,
        num_requests=16,
        prompt_len=ctx,
        max_num_batched_tokens=8192,
        decode_steps=32,
        chunk_size=512,
        max_model_len=ctx + 1024,
    )
    for ctx in SCALING_CONTEXTS
)


def all_workloads() -> tuple[StepWorkload, ...]:
    """The step workloads, then the scaling set, in reporting order."""
    return STEP_WORKLOADS + SCALING_WORKLOADS


_BY_NAME: Mapping[str, StepWorkload] = MappingProxyType({w.name: w for w in all_workloads()})


def workload(name: str) -> StepWorkload:
    """The workload called ``name``; ``KeyError`` listing the known names otherwise."""
    try:
        return _BY_NAME[name]
    except KeyError:
        known = ", ".join(w.name for w in all_workloads())
        raise KeyError(f"unknown workload {name!r}; known: {known}") from None
