"""vLLM's own model code as the oracle for the per-layer families the CPU build runs: Gemma-4
(window and full layers of different kv heads and head dims, ``attention_k_eq_v``) and
Gemma-3n, both with KV-shared layers.

Each case is a bundled config (the published shapes) with sizes overridden only: fewer layers
keeping the layer-kind pattern, a small hidden size, MLP and vocabulary; kv heads, head dims
and windows stay as published, and ``num_kv_shared_layers`` is cut in proportion so the shrunk
model still shares. ``oracle_runner.py`` starts each in the engine virtualenv's vLLM (the CPU
build) and writes its worker's ``get_kv_cache_spec()``: vLLM's ``GPUModelRunner`` leaves the
KV-shared layers out, and kvforge's plan of the same config must give the same layers with
equal specs, field by field, at the block size vLLM resolved. MiMo-V2 (needs Triton) and
Llama-Nemotron NAS (its config class is remote code) do not start on the CPU build: their
specs are checked against vLLM's declared ones in
``tests/integrations/test_vllm_specs_per_layer.py``.
"""

from __future__ import annotations

import copy
import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="the vLLM integration needs vLLM (pip install 'kvforge[vllm]')")

from _engines import engine_lock, engine_missing, engine_python
from oracle_runner import spec_record

from kvforge.integrations.vllm.specs import to_vllm_specs
from kvforge.models import from_hf_config, kv_sharing, load_model_config

pytestmark = pytest.mark.engine

RUNNER = Path(__file__).resolve().parent / "oracle_runner.py"
SIZES = {"hidden_size": 64, "intermediate_size": 128, "vocab_size": 512}

CASES: dict[str, tuple[str, str, int, int]] = {
    # name: (bundled config, language-model architecture, layers kept, shared layers)
    "gemma-4-31b": ("gemma-4-31b", "Gemma4ForCausalLM", 12, 4),
    "gemma-3n-e4b": ("gemma-3n-e4b", "Gemma3nForCausalLM", 10, 4),
}


def shrunk(name: str) -> dict[str, Any]:
    """The bundled config's language model with sizes overridden (shapes as published)."""
    bundled, arch, layers, shared = CASES[name]
    config = copy.deepcopy(load_model_config(bundled))
    text = config["text_config"] | SIZES
    text |= {
        "architectures": [arch],
        "torch_dtype": config["torch_dtype"],
        "num_hidden_layers": layers,
        "layer_types": text["layer_types"][:layers],
        "num_kv_shared_layers": shared,
        "max_position_embeddings": 512,
        "vocab_size_per_layer_input": 512,
        "hidden_size_per_layer_input": 16,
    }
    if text["model_type"] == "gemma3n_text":
        text |= {"laurel_rank": 8, "activation_sparsity_pattern": [0.0] * layers}
    return text


@pytest.fixture(scope="module")
def oracle(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    missing = engine_missing()
    if missing is not None:
        pytest.skip(missing)
    python = engine_python()
    assert python is not None
    tmp = tmp_path_factory.mktemp("oracle_per_layer")
    cases = [
        {"name": name, "config": shrunk(name), "engine": {"max_model_len": 256}} for name in CASES
    ]
    (tmp / "cases.json").write_text(json.dumps({"cases": cases}))
    with engine_lock():
        done = subprocess.run(
            [python, str(RUNNER), str(tmp / "cases.json"), str(tmp / "out.json")],
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
        )
    if done.returncode != 0 or not (tmp / "out.json").is_file():
        pytest.fail(f"oracle_runner exited {done.returncode}:\n{done.stderr[-4000:]}")
    return {r["name"]: r for r in json.loads((tmp / "out.json").read_text())["cases"]}


@pytest.mark.parametrize("name", sorted(CASES))
def test_layer_specs_equal_vllms(oracle: dict[str, dict[str, Any]], name: str) -> None:
    record = oracle[name]
    assert record["error"] is None, f"vLLM did not start {name}: {record['error']}"
    config = shrunk(name)
    plan = from_hf_config(config)
    ours = {
        n: spec_record(s)
        for n, s in to_vllm_specs(plan, block_size=record["resolved"]["block_size"]).items()
    }
    theirs = record["layers"]
    # the KV-shared layers have no spec in vLLM and no cache in kvforge
    assert len(kv_sharing(config)) == CASES[name][3]
    assert list(ours) == list(theirs)
    assert [int(n.split(".")[2]) for n in theirs] == sorted(plan)
    diffs = {
        n: {k: (ours[n][k], v) for k, v in theirs[n].items() if k in ours[n] and ours[n][k] != v}
        for n in theirs
    }
    assert diffs == {n: {} for n in theirs}
