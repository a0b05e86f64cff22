"""What the engines assume where a published ``config.json`` leaves a field out.

A published config states only what differs from its Hugging Face configuration class; the
engines (vLLM, SGLang, transformers) load it through that class, so every field it leaves out
takes the class's default. Gemma-3-4B's config, for one, states neither ``head_dim`` nor the
head counts: the class says 256, 8 and 4, and vLLM's ``Gemma3Attention``
(``vllm/model_executor/models/gemma3.py``) reads them from the loaded config. Reading only
what the file says would plan ``hidden_size // num_attention_heads`` (320, or 240 for
Gemma-3-12B) instead.

Each table below copies, for one ``model_type``, the defaults of the cache fields from its
configuration class in ``transformers`` 5.x (the file is named beside the table). A field a
config leaves out takes the default; a field present in the config wins, ``null`` included
(``"sliding_window": null`` means no window, as it does to the class). :func:`with_defaults`
applies a table; :func:`engine_window` applies vLLM's rule for a window of 0.

This module sits at the bottom of :mod:`kvforge.models` beside :mod:`~kvforge.models.base`:
it imports nothing else of the package.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

__all__ = [
    "GEMMA3_TEXT",
    "MINIMAX_M2",
    "MINISTRAL3",
    "MISTRAL",
    "MISTRAL3_TEXT",
    "OLMO2",
    "PHI3",
    "QWEN2_5_VL_TEXT",
    "QWEN3_5_MOE_TEXT",
    "QWEN3_5_TEXT",
    "QWEN3_VL_MOE_TEXT",
    "QWEN3_VL_TEXT",
    "STEP3P5_TEXT",
    "engine_window",
    "with_defaults",
]

Defaults = Mapping[str, Any]


def _table(**fields: Any) -> Defaults:
    return MappingProxyType(dict(fields))


GEMMA3_TEXT = _table(
    hidden_size=2304,
    num_hidden_layers=26,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=256,
    sliding_window=4096,
    sliding_window_pattern=6,
    max_position_embeddings=131_072,
)
"""``Gemma3TextConfig`` (``transformers/models/gemma3/configuration_gemma3.py``): its
``__post_init__`` builds ``layer_types`` from ``sliding_window_pattern`` (default 6) when the
config has none."""

PHI3 = _table(
    hidden_size=3072,
    num_hidden_layers=32,
    num_attention_heads=32,
    max_position_embeddings=4096,
    sliding_window=None,
)
"""``Phi3Config`` (``transformers/models/phi3/configuration_phi3.py``);
``num_key_value_heads`` defaults to ``num_attention_heads``, ``head_dim`` is
``hidden_size // num_attention_heads`` (vLLM's ``LlamaAttention``, which ``Phi3ForCausalLM``
subclasses in ``vllm/model_executor/models/phi3.py``)."""

OLMO2 = _table(
    hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, max_position_embeddings=2048
)
"""``Olmo2Config`` (``transformers/models/olmo2/configuration_olmo2.py``); vLLM runs OLMo-2
through its Transformers backend (``vllm/model_executor/models/transformers/base.py``), whose
head size is ``hidden_size // num_attention_heads`` for this class."""

MINIMAX_M2 = _table(
    hidden_size=3072,
    num_hidden_layers=62,
    num_attention_heads=48,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=196_608,
)
"""``MiniMaxM2Config`` (``transformers/models/minimax_m2/configuration_minimax_m2.py``)."""

MISTRAL = _table(
    hidden_size=4096,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    max_position_embeddings=131_072,
    sliding_window=4096,
)
"""``MistralConfig`` (``transformers/models/mistral/configuration_mistral.py``): the text
config of a ``mistral3`` wrapper whose ``text_config.model_type`` is ``"mistral"``. Its
``sliding_window`` default is 4096: a text config that leaves it out slides."""

MINISTRAL3 = _table(
    hidden_size=4096,
    num_hidden_layers=34,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=262_144,
    sliding_window=None,
)
"""``Ministral3Config`` (``transformers/models/ministral3/configuration_ministral3.py``)."""

MISTRAL3_TEXT = _table(
    head_dim=128,
    hidden_size=5120,
    num_attention_heads=32,
    num_hidden_layers=40,
    num_key_value_heads=8,
    max_position_embeddings=131_072,
    sliding_window=None,
)
"""What ``Mistral3Config`` (``transformers/models/mistral3/configuration_mistral3.py``,
``sub_configs_defaults``) builds when a ``mistral3`` config has no ``text_config`` at all."""

QWEN2_5_VL_TEXT = _table(
    hidden_size=8192,
    num_hidden_layers=80,
    num_attention_heads=64,
    num_key_value_heads=8,
    max_position_embeddings=32_768,
    use_sliding_window=False,
    sliding_window=4096,
    max_window_layers=80,
)
"""``Qwen2_5_VLTextConfig`` (``transformers/models/qwen2_5_vl/configuration_qwen2_5_vl.py``):
layers ``>= max_window_layers`` slide only with ``use_sliding_window``."""

QWEN3_VL_TEXT = _table(
    hidden_size=4096,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=32,
    head_dim=128,
    max_position_embeddings=128_000,
)
"""``Qwen3VLTextConfig`` (``transformers/models/qwen3_vl/configuration_qwen3_vl.py``)."""

QWEN3_VL_MOE_TEXT = _table(
    hidden_size=2048,
    num_hidden_layers=24,
    num_attention_heads=16,
    num_key_value_heads=16,
    max_position_embeddings=128_000,
)
"""``Qwen3VLMoeTextConfig`` (``transformers/models/qwen3_vl_moe/configuration_qwen3_vl_moe.py``):
``head_dim`` is ``hidden_size // num_attention_heads`` when absent, and ``__post_init__`` sets
``sliding_window`` to ``None`` whatever the config says."""

QWEN3_5_TEXT = _table(
    hidden_size=4096,
    num_hidden_layers=32,
    num_attention_heads=16,
    num_key_value_heads=4,
    head_dim=256,
    max_position_embeddings=32_768,
    linear_conv_kernel_dim=4,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    linear_num_key_heads=16,
    linear_num_value_heads=32,
    full_attention_interval=4,
)
"""``Qwen3_5TextConfig`` (``transformers/models/qwen3_5/configuration_qwen3_5.py``): its
``__post_init__`` builds ``layer_types`` from ``full_attention_interval`` (default 4)."""

QWEN3_5_MOE_TEXT = _table(
    hidden_size=2048,
    num_hidden_layers=40,
    num_attention_heads=16,
    num_key_value_heads=2,
    head_dim=256,
    max_position_embeddings=32_768,
    linear_conv_kernel_dim=4,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    linear_num_key_heads=16,
    linear_num_value_heads=32,
    full_attention_interval=4,
)
"""``Qwen3_5MoeTextConfig`` (``transformers/models/qwen3_5_moe/configuration_qwen3_5_moe.py``)."""

STEP3P5_TEXT = _table(
    hidden_size=4096,
    num_hidden_layers=45,
    num_attention_heads=64,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=128_000,
    sliding_window=None,
)
"""``Step3p7TextConfig`` (``transformers/models/step3p7/configuration_step3p7.py``), the
class vLLM loads ``step3p5`` configs with (``vllm/transformers_utils/config.py``:
``step3p5="Step3p7TextConfig"``). Its ``attribute_map`` makes ``num_attention_groups`` the
name of ``num_key_value_heads``; ``layer_types`` defaults to full attention everywhere."""


def with_defaults(config: Mapping[str, Any], defaults: Defaults) -> dict[str, Any]:
    """``config`` with every field of ``defaults`` it leaves out added (a new dict).

    A field the config has, ``null`` included, is kept: only an absent one takes the
    default, as in the configuration classes.
    """
    merged = dict(config)
    for key, value in defaults.items():
        if key not in merged:
            merged[key] = value
    return merged


def engine_window(config: Mapping[str, Any]) -> dict[str, Any]:
    """``config`` with a ``sliding_window`` of 0 read as no window (a new dict).

    vLLM's ``ModelConfig`` (``vllm/config/model.py``: "Some checkpoints set sliding_window to
    0 to indicate that sliding window is disabled") turns 0 into ``None`` before any layer
    reads it.
    """
    merged = dict(config)
    window = merged.get("sliding_window")
    if window == 0 and not isinstance(window, bool):
        merged["sliding_window"] = None
    return merged
