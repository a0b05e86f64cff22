"""vLLM's own model code as the oracle for the MLA families the CPU build runs (issue 35,
item 3): GLM-4.7-Flash (``glm4_moe_lite``) and Kimi-K2.5's language model (Kimi-K2, run as
``DeepseekV3ForCausalLM``, as vLLM's ``kimi_k25.py`` builds it).

Each case is a bundled config (the published cache fields) with sizes overridden only: two
layers, a small vocabulary, hidden, MLP and expert sizes; ``kv_lora_rank`` and
``qk_rope_head_dim`` stay as published. ``oracle_runner.py`` starts vLLM's CPU build on each
(``load_format="dummy"``) in the engine virtualenv and writes the worker's
``get_kv_cache_spec()`` and the scheduler's groups; kvforge's side is the plan of the same
config (Kimi-K2.5: the shrunk wrapper, whose ``text_config`` kvforge reads) at the block size
vLLM resolved, through ``to_vllm_specs``. GLM-5 (``glm_moe_dsa``, DSA) does not start on the
CPU build ("Sparse Attention is not supported on CPU"): it is compared with the specs its model
classes declare in ``tests/integrations/test_vllm_specs_mla_families.py``.

One field differs, by design: ``block_stride_alignment``, which vLLM's worker sets from the
attention backend it picked (``customize_attention_spec`` in ``vllm/v1/worker/utils.py``: the
CPU MLA backend's kernel blocks of 16 tokens, ``MultipleOf(16)``), not from the model; at the
resolved block of 16 it asks for no padding, so the pages are equal byte for byte.
"""

from __future__ import annotations

import json
import os
import subprocess
from typing import Any

import pytest

pytest.importorskip("vllm", reason="the vLLM integration needs vLLM (pip install 'kvforge[vllm]')")

from _engines import engine_lock, engine_missing, engine_python
from oracle_runner import spec_record
from test_vllm_oracle import RUNNER

from kvforge.core.layout import CacheLayout
from kvforge.integrations.vllm.specs import to_vllm_specs
from kvforge.models import from_hf_config, load_model_config

pytestmark = pytest.mark.engine

SIZES = {
    "num_hidden_layers": 2,
    "hidden_size": 256,
    "intermediate_size": 128,
    "moe_intermediate_size": 64,
    "vocab_size": 512,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "first_k_dense_replace": 1,
    "n_group": 1,
    "topk_group": 1,
}
"""Sizes every case overrides (weights only: no cache field)."""

KNOWN = {"block_stride_alignment"}


def planned_config(bundled: str) -> dict[str, Any]:
    """What kvforge plans: the bundled config with :data:`SIZES` (a wrapper's in its
    ``text_config``)."""
    config = load_model_config(bundled)
    config.get("text_config", config).update(SIZES)
    return config


def engine_config(bundled: str) -> dict[str, Any]:
    """What vLLM starts on: the planned config, or a wrapper's language model (its
    ``text_config`` as ``DeepseekV3ForCausalLM``, in the wrapper's dtype)."""
    config = planned_config(bundled)
    if "text_config" not in config:
        return config
    text = dict(config["text_config"])
    text["architectures"] = ["DeepseekV3ForCausalLM"]
    text.setdefault("torch_dtype", config["torch_dtype"])
    return text


CASES = {"glm4_moe_lite": "glm-4.7-flash", "kimi_k25": "kimi-k2.5"}


@pytest.fixture(scope="module")
def oracle(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    missing = engine_missing()
    if missing is not None:
        pytest.skip(missing)
    tmp = tmp_path_factory.mktemp("oracle-mla")
    cases = [
        {"name": name, "config": engine_config(bundled), "engine": {"max_model_len": 4096}}
        for name, bundled in CASES.items()
    ]
    (tmp / "cases.json").write_text(json.dumps({"cases": cases}))
    with engine_lock():
        done = subprocess.run(
            [engine_python(), str(RUNNER), str(tmp / "cases.json"), str(tmp / "out.json")],
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
            env=os.environ,
        )
    if done.returncode != 0 or not (tmp / "out.json").is_file():
        pytest.fail(f"oracle_runner exited {done.returncode}:\n{done.stderr[-4000:]}")
    out = json.loads((tmp / "out.json").read_text())
    return {record["name"]: record for record in out["cases"]}


@pytest.mark.parametrize("name", sorted(CASES))
def test_layer_specs_and_groups_equal_vllms(oracle: dict[str, dict[str, Any]], name: str) -> None:
    record = oracle[name]
    assert record["error"] is None, f"vLLM did not start {name}: {record['error']}"
    block = record["resolved"]["block_size"]
    plan = from_hf_config(planned_config(CASES[name]))
    ours = {n: spec_record(s) for n, s in to_vllm_specs(plan, block_size=block).items()}
    theirs = record["layers"]
    assert list(ours) == list(theirs) == [f"model.layers.{i}.self_attn.attn" for i in range(2)]
    for layer, spec in theirs.items():
        diff = {k for k in ours[layer].keys() & spec.keys() if ours[layer][k] != spec[k]}
        assert diff == KNOWN, (layer, diff)
        # the CPU MLA backend's kernel block is the whole block: no padding between blocks
        assert spec["block_stride_alignment"] == {"multiple_of": block}
        assert spec["page_size_bytes"] == ours[layer]["page_size_bytes"]
        # MLA bf16: (kv_lora_rank 512 + qk_rope_head_dim 64) * 2 B a token
        assert spec["page_size_bytes"] == block * (512 + 64) * 2
    # vLLM forms one group of both layers; kvforge plans one group `kv` of them
    (group,) = record["groups"]
    assert group["layers"] == list(theirs)
    assert [(g.name, g.block_size) for g in CacheLayout(plan).groups] == [("kv", 64)]
