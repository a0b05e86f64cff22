"""The tiny step workload the benchmark tests share: 3 requests of 300 prompt tokens in
128-token chunks (3 prefill steps: 128, 128, 44 each), then 5 decode steps; 300 + 5 + 1 tokens
fit in 512. ``chunk_size=None``: each prompt in one step."""

from __future__ import annotations

from typing import Any

from step_sim import load_step_workloads

SW = load_step_workloads()


def tiny(groups: Any, name: str = "tiny", chunk_size: int | None = 128) -> Any:
    return SW.StepWorkload(
        name=name,
        groups=groups,
        num_requests=3,
        prompt_len=300,
        max_num_batched_tokens=512 if chunk_size else 1024,
        decode_steps=5,
        chunk_size=chunk_size,
        max_model_len=512,
    )
